"""The command line shared by the benchmarks run as ``python -m benchmarks.NAME``.

A benchmark module defines ``add_args(parser)``, which adds its flags and sets ``func`` (called with the
parsed namespace; it returns the exit status), and ends with::

    if __name__ == "__main__":
        sys.exit(run("NAME", __doc__, add_args))

Bad input (a ``ValueError``, which ``ConfigError`` is, or an unreadable file) ends with one line on
stderr and exit status 2, as ``kvtier`` does; ``KVTIER_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence


def run(
    name: str,
    doc: str | None,
    add_args: Callable[[argparse.ArgumentParser], None],
    argv: Sequence[str] | None = None,
) -> int:
    """Parse ``argv`` with ``add_args``'s flags and run the benchmark; its exit status."""
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_args(parser)
    ns = parser.parse_args(argv)
    try:
        return int(ns.func(ns) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as exc:
        if os.environ.get("KVTIER_DEBUG"):
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"benchmarks.{name}: error: {message}", file=sys.stderr, flush=True)
        return 2
