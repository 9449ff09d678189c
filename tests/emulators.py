"""The cloud metadata emulators the tests point ``runner.notices`` at: they live in
bench/emulators.py, since bench/goodput.py sends its notices through them too and a benchmark
does not import the tests; this name stays for the tests that import it."""

from bench.emulators import (AwsImdsEmulator, AzureScheduledEventsEmulator, GcpMetadataEmulator, Served,
                             closed_port_url)

__all__ = ["AwsImdsEmulator", "AzureScheduledEventsEmulator", "GcpMetadataEmulator", "Served", "closed_port_url"]
