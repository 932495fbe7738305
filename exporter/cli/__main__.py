"""python -m exporter.cli, where the console script is not on PATH."""

from exporter.cli import main

if __name__ == "__main__":
    main()
