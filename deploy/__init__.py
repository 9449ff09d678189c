"""The deploy templates (systemd unit, cloud-init user-data), shipped as package data and read with
importlib.resources by runner/deploy/."""
