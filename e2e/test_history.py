"""Back and Forward between chats restore each page cleanly: htmx finds nothing in a restored
page to swap out of band (it would log htmx:oobErrorNoTarget for each such element)."""

import re

from playwright.sync_api import Page, expect

from chat_page import last, new_chat, open_new_chat, send, wait_answer


# Counts the states the page's chat sockets send (one on each connect), across boosted moves.
COUNT_SOCKET_STATES = ("window.socketStates = 0; "
                       "document.addEventListener('htmx:wsAfterMessage', () => window.socketStates++)")


def test_back_and_forward_between_chats_log_no_errors(page: Page):
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    chats = {}
    for text in ("First chat", "Second chat"):
        cid = new_chat(page, max_tokens=2)
        send(page, text)
        wait_answer(page)  # its final version came over the socket, out of band
        chats[cid] = text
    (first, first_text), (second, second_text) = chats.items()
    # Each move waits for the chat's socket to send its state: a socket closed while still
    # connecting (a move within moments of the last) is reported by htmx's ws extension as an
    # error of its own, which is not what this test is about.
    page.evaluate(COUNT_SOCKET_STATES)
    moves = [(lambda: page.click(f"#conversation-list a[href='/c/{first}']"), first, first_text),
             (page.go_back, second, second_text), (page.go_forward, first, first_text),
             (page.go_back, second, second_text)]
    for move, cid, text in moves:
        seen = page.evaluate("window.socketStates")
        move()
        expect(page).to_have_url(re.compile(f"/c/{cid}$"))
        expect(last(page, "user")).to_contain_text(text)
        expect(last(page, "assistant")).to_have_attribute("data-state", "done")
        page.wait_for_function(f"() => window.socketStates > {seen}")
    assert not errors, errors


def test_a_resized_composer_goes_to_another_chat_without_a_csp_error(page: Page):
    """Dragging the composer's corner gives it a style attribute; htmx settled `style` onto the
    next page's composer, which the CSP (no inline style) refused with a console error."""
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    first = new_chat(page, max_tokens=2)
    send(page, "Hello")
    wait_answer(page)
    page.add_init_script(COUNT_SOCKET_STATES)
    open_new_chat(page)  # a page load, then a boosted move: two sockets, each sends its state
    page.wait_for_function("() => window.socketStates >= 2")  # connected: leaving now closes no half-open socket
    box = page.locator("#prompt").bounding_box()
    corner = (box["x"] + box["width"] - 3, box["y"] + box["height"] - 3)
    page.mouse.move(*corner)
    page.mouse.down()
    page.mouse.move(corner[0], corner[1] - 60, steps=5)  # a drag of the resize handle
    page.mouse.up()
    expect(page.locator("#prompt")).to_have_attribute("style", re.compile("height"))
    page.click(f"#conversation-list a[href='/c/{first}']")
    expect(page).to_have_url(re.compile(f"/c/{first}$"))
    expect(last(page, "user")).to_contain_text("Hello")
    page.wait_for_timeout(300)  # htmx settles the swapped page after 20 ms
    assert not errors, errors
