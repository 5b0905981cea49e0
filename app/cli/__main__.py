"""The `mlxchat` command and `python -m app.cli`: on Linux, OpenBLAS must be preloaded before MLX
starts, so the process first runs again with it where that pays (`restart_with_blas`, which
imports nothing heavy), and only then imports the CLI with MLX and mlx-lm: they load once."""

from engine import restart_with_blas


def start() -> None:
    restart_with_blas("app.cli")
    from app.cli.commands import main

    main()


if __name__ == "__main__":
    start()
