"""Optional dependencies imported on first use, failing with the extra to install.

`import_mooncake` lives here, below both of its users (`transfer.backend`, the transfer engine;
`kvstore.backend`, the store client): the same wheel ships both."""

from __future__ import annotations

import importlib
import os
from typing import Any

from aioprefill.errors import InvalidConfig

__all__ = ["TRANSFER_EXTRA_HINT", "import_mooncake", "import_optional"]


def import_optional(module: str, extra: str) -> Any:
    """Import an optional dependency, or raise `InvalidConfig` naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise InvalidConfig(
            f"aioprefill needs the {module!r} package, not installed here: "
            f"pip install 'aioprefill[{extra}]'"
        ) from exc


TRANSFER_EXTRA_HINT = (
    "pip install 'aioprefill[transfer]' (mooncake-transfer-engine-non-cuda; on a CUDA machine "
    "mooncake-transfer-engine), and on Debian/Ubuntu apt-get install libibverbs1"
)


def import_mooncake(module: str, what: str) -> Any:
    """Mooncake's `module` (`mooncake.engine`, `mooncake.store`), or InvalidConfig naming `what`
    could not load and what to install. The wheel links libibverbs even for TCP, so without
    Debian's libibverbs1 the import itself fails (OSError/ImportError naming libibverbs.so.1).
    Its C++ log level is read once, at load: unless MC_LOG_LEVEL says otherwise, only errors (a
    dozen info lines per engine start otherwise)."""
    quiet = "MC_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["MC_LOG_LEVEL"] = "ERROR"
    try:
        return importlib.import_module(module)
    except (ImportError, OSError) as exc:
        raise InvalidConfig(f"{what} cannot be imported ({exc}): {TRANSFER_EXTRA_HINT}") from exc
    finally:
        if quiet:
            del os.environ["MC_LOG_LEVEL"]
