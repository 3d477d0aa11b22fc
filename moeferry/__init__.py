"""moeferry: serve Mixture-of-Experts models larger than the GPU."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):  # lazy: `import moeferry` stays cheap for the CLI
    if name == "LLM":
        from moeferry.llm import LLM

        return LLM
    if name == "SamplingParams":
        from moeferry.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
