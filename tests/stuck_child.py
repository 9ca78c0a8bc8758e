"""A child of launch.py that will not stop: it ignores SIGTERM and waits for ever in ``stuck_here``
(tests/test_supervision.py: the driver asks for its stacks before it SIGKILLs it; tests/test_ray.py: the
same as a role's ``main`` inside a Ray actor)."""

import signal
import threading

from tandem.procs import exit_with_driver


def stuck_here() -> None:
    threading.Event().wait()


def main(argv: list[str] | None = None) -> int:
    exit_with_driver()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("stuck child: ready", flush=True)
    stuck_here()
    return 0


if __name__ == "__main__":
    main()
