"""Serve a local HF model over a minimal OpenAI-compatible chat-completions API (greedy by default)."""

from flashdraft.errors import cli
from flashdraft.serve import main

if __name__ == "__main__":
    cli(main)()
