"""pytest setup for tests/soak (not part of the default `pytest tests/python` run): registers the `soak` marker."""


def pytest_configure(config):
    config.addinivalue_line("markers", "soak: minutes-long soak against the real server (not in the default run)")
