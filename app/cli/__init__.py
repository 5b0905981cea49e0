"""The `mlxchat` command: `commands.py` holds its commands (click), `launch.py` runs a coding agent
against the server (`mlxchat launch`), `__main__.py` starts it. This package's own import stays
light (nothing of MLX or mlx-lm), so that `__main__.py` can settle the OpenBLAS preload first."""
