"""Serve a local HF model over a minimal OpenAI-compatible chat-completions API (greedy by default)."""

from flashdraft.serve import main

if __name__ == "__main__":
    main()
