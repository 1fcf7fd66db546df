"""Serve a local HF model over a minimal OpenAI-compatible chat-completions API (greedy by default)."""

import argparse

from flashdraft.serve import Server


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", required=True, help="HF model directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--name", default=None, help="model name clients send (default: --target)")
    ap.add_argument("--fail-every", type=int, default=0, help="answer every N-th request with 503 (tests)")
    args = ap.parse_args()
    srv = Server(args.target, args.host, args.port, args.dtype, args.name, args.fail_every)
    print(f"serving {srv.name} on http://{args.host}:{srv.server_address[1]}/v1", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()


if __name__ == "__main__":
    main()
