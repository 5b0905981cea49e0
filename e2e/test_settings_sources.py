"""The settings panel says where each sampling default comes from."""

from playwright.sync_api import Page, expect

from chat_page import open_new_chat


def test_settings_panel_shows_each_defaults_source(page: Page, shot):
    open_new_chat(page)
    page.click("#settings summary")
    expect(page.locator("input[name=temperature]")).to_be_visible()
    # A new chat keeps the settings of the one it came from (other tests set greedy): back to the
    # model's own values first.
    page.select_option("select[name=preset]", "recommended")
    source = lambda field: page.locator(f"#settings-form .source[data-field={field}]")
    expect(source("temperature")).to_have_text("0.2: mlxchat's preset for this model")
    expect(source("repetition_penalty")).to_have_text("1.1: mlxchat's preset for this model")
    expect(source("top_k")).to_have_text("0: mlxchat's default")
    expect(page.locator("input[name=temperature]")).to_have_attribute("placeholder", "0.2")
    page.fill("input[name=temperature]", "0.7")
    page.click("#settings-form button[type=submit]")
    expect(page.locator("#settings-form .saved")).to_be_visible()
    expect(source("temperature")).to_have_text(
        "this conversation's setting (model default: 0.2, mlxchat's preset for this model)")
    shot(page, "settings-sources")
    page.fill("input[name=max_tokens]", "77")  # typed, not saved: no preset sets it, so it stays
    page.select_option("select[name=preset]", "recommended")  # back to the model's own values
    expect(source("temperature")).to_have_text("0.2: mlxchat's preset for this model")
    expect(page.locator("input[name=temperature]")).to_have_value("")
    expect(page.locator("input[name=max_tokens]")).to_have_value("77")
