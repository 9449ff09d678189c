"""The report's engine line for an asynchronous run (spec.parameters.staleness): its lag and the
newest step's importance ratios."""

from grpo_run.runner.views.report import _engine


def test_an_asynchronous_run_s_engine_line_says_its_staleness_and_the_newest_step_s_ratios():
    steps = [{"step": 1}, {"step": 2, "isRatioMean": 1.01, "isRatioMin": 0.5, "isRatioMax": 2.5, "isTruncated": 0.02}]
    assert _engine({"engine": "native", "staleness": 2.0}, steps) == (
        "native decoder, asynchronous (staleness 2); newest step: importance ratio mean 1.010 (min 0.500, "
        "max 2.500), 2.0% truncated")
    assert _engine({"engine": "native"}, steps) == "native decoder"
