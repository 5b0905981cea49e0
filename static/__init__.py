"""Static files the browser loads: vendored htmx and its ws/sse extensions, CSS, a little JS."""
