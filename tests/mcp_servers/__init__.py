"""Real MCP servers for the tests, written with the official SDK (`mcp.server.mcpserver`)."""
