"""MCP tools for chats in the UI: `mcp.json` (config), the servers it names, run and listed
(servers), the user's approval of each call (approval) and the tool rounds of a chat turn
(rounds). API clients bring their own tools; nothing here serves the API."""
