"""The package imports, exposes its version and an explicit, resolvable __all__."""

import importlib
import importlib.metadata


def test_public_names_resolve() -> None:
    module = importlib.import_module("ppo_lifecycle")
    # The version the package reports is the one it is installed (and released) as.
    assert module.__version__ == importlib.metadata.version("ppo-lifecycle")
    assert isinstance(module.__all__, list)
    for name in module.__all__:
        assert hasattr(module, name), (
            f"ppo_lifecycle.__all__ lists {name!r} but the package does not define it"
        )
