"""Example models and data used by the tests, benchmarks and README (``examples.gpt``)."""
