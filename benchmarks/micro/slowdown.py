"""A pytest plugin that makes every timed call do its work twice: the regression the CI gate must catch.

Not loaded unless named (``-p slowdown`` with this folder on ``PYTHONPATH``); it wraps the functions
``test_cpu_paths`` times so each call runs the function twice and returns the second result:

    PYTHONPATH=.:benchmarks/micro python -m pytest benchmarks/micro --benchmark-only -p slowdown ...
"""

import functools

#: the functions test_cpu_paths hands to ``benchmark``
TIMED = ("quantize", "quantize_with_clip_search", "pack_int4", "quantize_activations_reference",
         "select_residual", "evaluate_perplexity")


def _twice(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


def pytest_collection_modifyitems(items):
    modules = {item.module for item in items if getattr(item, "module", None) is not None}
    for module in modules:
        for name in TIMED:
            if hasattr(module, name):
                setattr(module, name, _twice(getattr(module, name)))
