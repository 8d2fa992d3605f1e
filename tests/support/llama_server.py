"""llama.cpp's own OpenAI-compatible server (its C++ ``llama-server``, as the prebuilt wheel
``xllamacpp`` in the test extra carries it) on one GGUF file, run as a process the way a user runs
``llama-server``: ``python tests/support/llama_server.py MODEL.gguf --port N --alias NAME``.

It prints its address once listening and serves until SIGTERM or SIGINT. One slot (``n_parallel``
1): requests queue one behind another instead of sharing the batch; ``--threads`` compute threads
(batch too)."""

from __future__ import annotations

import argparse
import signal
import threading


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--alias", help="the model name that /v1/models lists")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ctx", type=int, default=2048, help="context length in tokens")
    parser.add_argument("--http-threads", type=int, default=8, help="connections served at once")
    args = parser.parse_args(argv)

    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    if args.alias:
        params.model_alias = {args.alias}
    params.port = args.port
    params.n_ctx = args.ctx
    params.n_parallel = 1
    # HTTP threads: a client's idle keep-alive connection holds one for 5 s, and a connection that
    # finds none free is closed unanswered (its default here: 3, fewer than a benchmark's pool)
    params.n_threads_http = args.http_threads
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = xllamacpp.Server(params)  # loads the model, then listens (its HTTP threads are C++'s)
    print(f"llama.cpp server listening on {server.listening_address}", flush=True)
    stop.wait()
    del server  # its destructor stops the HTTP threads and frees the model


if __name__ == "__main__":
    main()
