"""One declaration of the sampling options (engine.SAMPLING_OPTIONS): the engine's parameters, the
API's accepted fields, the CLI's flags and the settings form all follow it."""

import pytest
from click.testing import CliRunner

from app.api.chat import parse_chat_request
from app.api.errors import ApiError
from app.ui.settings import SAMPLING_FIELDS, parse_settings_form, sampling_params
from app.cli.commands import cli
from engine import SAMPLING_OPTIONS, InvalidRequest, SamplingParams

pytestmark = pytest.mark.fast

MODEL = "m"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def outside(option):
    """A value just outside the option's range (and not the value that means "unset")."""
    if option.low is None:
        return option.high + 1
    return option.low - (2 if option.unset == option.low - 1 else 1)


@pytest.mark.parametrize("option", SAMPLING_OPTIONS, ids=lambda o: o.name)
def test_every_option_is_a_parameter_with_its_default_and_range(option):
    assert getattr(SamplingParams(), option.name) == option.default
    edge = option.low if option.low is not None and not option.low_open else option.high
    assert getattr(SamplingParams(**{option.name: option.kind(edge)}), option.name) == edge
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**{option.name: outside(option)})
    assert (info.value.field, info.value.code) == (option.name, "invalid_value")
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**{option.name: "1"})
    assert (info.value.field, info.value.code) == (option.name, "invalid_type")


@pytest.mark.parametrize("option", SAMPLING_OPTIONS, ids=lambda o: o.name)
def test_the_api_accepts_every_option_and_names_the_bad_one(option):
    value = option.low + 1 if option.high is None else option.kind((option.low + option.high) / 2) \
        if option.kind is float else (option.low + option.high) // 2
    assert getattr(parse_chat_request({**BODY, option.name: value}, MODEL).params, option.name) == value
    with pytest.raises(ApiError) as info:
        parse_chat_request({**BODY, option.name: outside(option)}, MODEL)
    assert (info.value.status, info.value.param, info.value.code) == (400, option.name, "invalid_value")


@pytest.mark.parametrize("option", SAMPLING_OPTIONS, ids=lambda o: o.name)
def test_the_cli_has_a_flag_per_option_refusing_values_out_of_range(option):
    flag = f"--{option.name.replace('_', '-')}"
    help_text = CliRunner().invoke(cli, ["generate", "--help"]).output
    assert flag in help_text
    result = CliRunner().invoke(cli, ["generate", "hi", flag, str(outside(option))])
    assert result.exit_code == 2 and "Invalid value for" in result.output and flag in result.output


@pytest.mark.parametrize("option", SAMPLING_OPTIONS, ids=lambda o: o.name)
def test_the_settings_form_has_a_field_per_option_and_puts_errors_on_it(option):
    assert SAMPLING_FIELDS[option.name] is option
    settings, errors = parse_settings_form({option.name: str(outside(option))})
    assert list(errors) == [option.name] and option.name in errors[option.name]
    settings, errors = parse_settings_form({option.name: "x"})
    assert list(errors) == [option.name] and option.label in errors[option.name]


def test_a_seed_of_minus_one_means_random_in_the_api_and_the_settings_form():
    """Many clients send seed -1 for "no seed"; -2 is still out of range."""
    assert parse_chat_request({**BODY, "seed": -1}, MODEL).params.seed is None
    with pytest.raises(ApiError) as info:
        parse_chat_request({**BODY, "seed": -2}, MODEL)
    assert (info.value.param, info.value.code) == ("seed", "invalid_value")
    settings, errors = parse_settings_form({"seed": "-1"})
    assert errors == {} and sampling_params(settings, None).seed is None
    assert list(parse_settings_form({"seed": "-2"})[1]) == ["seed"]
