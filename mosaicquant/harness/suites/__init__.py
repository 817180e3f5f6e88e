"""Built-in suites: ``accuracy`` (perplexity) and the others as they are registered.

A suite is ``fn(model, config, ctx: SuiteContext) -> dict[str, Metric]`` registered with
:func:`mosaicquant.registry.register_suite`.
"""
