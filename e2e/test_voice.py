"""Voice in the page (issue 53), in Chromium with a fake microphone that speaks tests/audio's
espeak-ng question: with no speech model the microphone says what to pull (and asks for no
microphone); with the tiny speech models installed, speaking fills the composer with the
transcript, the answer comes, and "Listen" reads it aloud, streamed."""

import shutil

import pytest
from playwright.sync_api import expect

from app.api.audio_codec import decode
from bench.speech_shapes import kokoro_folder, whisper_folder
from engine import SPEECH_SUGGESTED
from chat_page import new_chat
from voice_models import KOKORO, QUESTION_WAV, WHISPER, install


@pytest.fixture
def mic_page(chromium_with, server):
    """A page in a Chromium whose microphone plays QUESTION_WAV (permission granted)."""
    page = chromium_with("--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                         f"--use-file-for-fake-audio-capture={QUESTION_WAV}",
                         base_url=server.url, permissions=["microphone"])
    problems = []
    page.on("pageerror", lambda e: problems.append(str(e)))
    yield page
    assert not problems, problems


def test_speak_a_question_and_hear_the_answer(mic_page, hf_cache, shot):
    page = mic_page
    new_chat(page, max_tokens=16)  # a short answer: a short clip to make and play
    page.click("#mic")  # no speech model installed yet
    expect(page.locator("#notice")).to_contain_text(
        f"mlxchat pull {SPEECH_SUGGESTED['transcription']}")
    expect(page.locator("#mic")).to_have_text("Speak")

    installed = [install(hf_cache, WHISPER, whisper_folder()),
                 install(hf_cache, KOKORO, kokoro_folder())]
    try:
        page.reload()
        mic = page.locator("#mic")
        mic.press("Enter")  # keyboard (focus, then Enter): the button records...
        expect(mic).to_have_attribute("aria-pressed", "true")
        page.wait_for_timeout(3000)
        mic.press("Enter")  # ...and stops
        expect(mic).to_have_text("Speak")
        prompt = page.locator("#prompt")
        expect(prompt).not_to_have_value("")
        transcript = prompt.input_value()
        page.click("#send")
        answer = page.locator(".message.assistant").last
        expect(answer).to_have_attribute("data-state", "done")
        expect(page.locator(".message.user").last).to_contain_text(transcript.split()[0])
        listen = answer.locator("button.speak")
        with page.expect_response(lambda r: r.url.endswith("/speech")) as spoken:
            listen.click()
        response = spoken.value
        assert response.status == 200 and response.headers["content-type"] == "audio/mpeg"
        # the whole clip (the stream's end) is sound that decodes; the page played it to its end
        # (or stopped on an error, which says "Read aloud: ...")
        assert decode(response.body(), 24_000, name="the answer's speech").size > 0
        expect(listen).to_have_text("Listen")
        expect(listen).to_have_attribute("aria-pressed", "false")
        expect(page.locator("#notice")).not_to_contain_text("Read aloud")
        shot(page, "voice")
    finally:
        for folder in installed:
            shutil.rmtree(folder.parent.parent)
