"""The test infrastructure both suites and bench/ share: loopback servers that replay recorded bodies, the
scripted and vLLM labs, real PostgreSQL, Prometheus and Alertmanager, fault injection, and the recordings
under tests/fixtures/."""
