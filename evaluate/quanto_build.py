"""optimum-quanto's C++ extension, built where the project controls it, and never waited on forever.

quanto compiles its CPU kernels (``quanto_cpp``: the unpacking of 2- and 4-bit tensors, which every dequantization
of a ``QuantizedCache`` runs) with torch's ``cpp_extension.load`` on first use, inside the installed package. torch
guards a build with a lock file in the build directory (``FileBaton``): a process that finds the file waits until it
disappears. A first run interrupted during the build leaves the file behind, and every later run then waits on it
forever, silently, at 0 % CPU.

So :func:`prepare_quanto` points the extension at a build directory of the project's (under
``$PRESSBENCH_BUILD_DIR``, else ``~/.cache/pressbench``, one per quanto and torch version), and builds or loads it
while holding an advisory ``flock`` on a file beside it. The kernel releases that lock when its holder dies, so a
process that holds it knows that no live process of the project is building: a torch lock file it finds then was
left by a dead build, and is removed. ``make install`` runs ``python -m evaluate.quanto_build`` once, so that
runs find the extension built.
"""

import fcntl
import logging
import os
from importlib.metadata import version
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

EXTENSION = "quanto_cpp"


def build_directory() -> Path:
    """Where the extension is built for this quanto and torch: a directory of the project's, not the package's."""
    root = Path(os.environ.get("PRESSBENCH_BUILD_DIR") or Path.home() / ".cache" / "pressbench")
    return root / f"{EXTENSION}-quanto{version('optimum-quanto')}-torch{torch.__version__}"


def prepare_quanto() -> None:
    """Build (once per machine) or load quanto's CPU extension in :func:`build_directory`, removing a lock file a dead
    build left; a no-op once loaded in this process."""
    from optimum.quanto.library.extensions import get_extension

    extension = get_extension(EXTENSION)
    if extension._lib is not None:
        return
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    extension.build_directory = str(directory)
    with open(directory / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # another live process builds: wait for it (its death releases this)
        stale = directory / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink()
        extension.lib  # noqa: B018  (the property builds or loads the library)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    prepare_quanto()
    print(f"quanto's CPU extension is built in {build_directory()}")
