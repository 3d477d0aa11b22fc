"""`moeferry serve` with a generated routing forced on its model (benchmarks/common.force_routing):
the server bench_serve starts under `--routing PROFILE`.

    python -m benchmarks.serve_routed PROFILE SEED SERVE_FLAGS...

The engine is built as `moeferry serve` builds it, the router hooks installed, the decode
graphs recaptured with them, then the app served as `moeferry serve` serves it.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from benchmarks.common import force_routing
    from moeferry.cli import build_parser, engine_config_from_args
    from moeferry.engine.engine import Engine
    from moeferry.server.app import ServerConfig, serve_engine

    if len(argv) < 2:
        print("usage: python -m benchmarks.serve_routed PROFILE SEED SERVE_FLAGS...", file=sys.stderr)
        return 2
    routing, seed = argv[0], int(argv[1])
    args = build_parser().parse_args(["serve", *argv[2:]])
    engine = Engine(engine_config_from_args(args).check())
    if force_routing(engine, routing, seed) is not None:
        engine.runner.recapture_graphs()  # the decode graphs draw the routes
    return serve_engine(engine, ServerConfig.from_args(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
