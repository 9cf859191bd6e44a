"""``python -m envs.openreward_examples [--port 8090] [--host 127.0.0.1]``: serve the example
OpenReward environments (``ToolAddition`` first, the default env; ``PlainAddition``)."""

import argparse
import os

os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")  # no call to the package index at start

from openreward.environments import Server  # noqa: E402

from envs.openreward_examples import ENVIRONMENTS  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m envs.openreward_examples", description=__doc__)
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    Server(ENVIRONMENTS).run(host=args.host, port=args.port)
