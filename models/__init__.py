"""The model zoo, data loaders, and the train / evaluate / benchmark scripts."""
