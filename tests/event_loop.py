"""`run(coroutine)`: `asyncio.run` on a thread of its own.

A test module sharing its pytest worker with the browser tests finds Playwright's sync event loop
still running on the main thread (e2e/conftest.py keeps one browser for the session), and
`asyncio.run` refuses to start there; a thread has no loop of its own until this one."""

import asyncio
from concurrent.futures import ThreadPoolExecutor


def run(coroutine):
    with ThreadPoolExecutor(1, thread_name_prefix="test-event-loop") as pool:
        return pool.submit(asyncio.run, coroutine).result()
