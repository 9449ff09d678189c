"""The layers of the grader's sandbox as the trainer sees them: what each can be, what a node needs
for it, and the error when one that had to be in force is not (`SandboxUnavailable`). The layers
themselves are `grpo_run.trainer.grader.sandbox`'s."""

from __future__ import annotations

from typing import Mapping, Sequence

__all__ = ["LAYERS", "SandboxUnavailable", "is_sandbox_frame"]

# The layers of the sandbox, what each can be (the last: not in force), and what a node needs for it.
LAYERS = {
    "network": ("netns", "python"),
    "filesystem": ("landlock", "python"),
    "signals": ("landlock", "pidns", "none"),
    "seccomp": ("on", "off"),
}
_FIXES = {
    "network": "allow user namespaces (sysctl user.max_user_namespaces > 0 and kernel.unprivileged_userns_clone=1; "
               "on Ubuntu 23.10+ also kernel.apparmor_restrict_unprivileged_userns=0), or in a container a seccomp "
               "profile that allows unshare(); or run the trainer as root with CAP_SYS_ADMIN",
    "filesystem": "a kernel with Landlock: Linux 5.13+ built with CONFIG_SECURITY_LANDLOCK=y and landlock in the "
                  "lsm= boot parameter (cat /sys/kernel/security/lsm)",
    "signals": "Linux 6.12+ (Landlock ABI 6 scopes signals), or user namespaces as for the network (then the worker "
               "gets a PID namespace of its own)",
    "seccomp": "an x86_64 node whose kernel has CONFIG_SECCOMP_FILTER",
}


class SandboxUnavailable(RuntimeError):
    """A layer of the reward sandbox that had to be in force (strict=True, or a setting naming a
    mechanism such as network="netns") is not on this node. str() names each and how to get it.
    The node's fault, not the reward function's: raised at once, never retried, before any of the
    reward's code ran."""

    def __init__(self, message: str, *, mode: Mapping[str, str], missing: Sequence[str]) -> None:
        super().__init__(message)
        self.mode = dict(mode)  # what was in force
        self.missing = tuple(missing)  # the layers that had to be and were not

    @classmethod
    def of(cls, ref: str, mode: Mapping[str, str], why: Mapping[str, str], missing: Sequence[str], *,
           strict: bool) -> SandboxUnavailable:
        """The error for reward function `ref` whose worker reported `mode` and `why`."""
        setting = "strict=True (spec.sandbox: strict)" if strict else "the grader's settings"
        lines = [f"  {layer}: {why.get(layer) or f'in force as {mode[layer]!r}, not the one asked for'}; "
                 f"to get it: {_FIXES[layer]}" for layer in missing]
        return cls(f"the sandbox for reward function {ref!r} lacks what {setting} requires, so the reward "
                   f"function was not run:\n" + "\n".join(lines), mode=mode, missing=missing)


def is_sandbox_frame(frame: dict) -> bool:
    """Whether `frame` is a well-formed sandbox report (the worker's first frame)."""
    mode, why, missing = frame.get("mode"), frame.get("why"), frame.get("missing")
    return (frame.get("type") == "sandbox" and isinstance(mode, dict) and mode.keys() == LAYERS.keys()
            and all(mode[layer] in values for layer, values in LAYERS.items())
            and isinstance(why, dict) and all(k in LAYERS and isinstance(v, str) for k, v in why.items())
            and isinstance(missing, list) and all(layer in LAYERS for layer in missing))
