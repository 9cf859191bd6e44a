"""Ray gauges reach the node's Prometheus endpoint (Ray's metrics agent) over HTTP."""

import time
import urllib.request

import ray

from otray import config


@ray.remote(num_cpus=0)
class SinkHolder:
    """Keeps a MetricSinks alive in a worker process, as a job driver does."""

    def log(self, row):
        from otray.metrics_sinks import MetricSinks

        cfg = config.load({"envs": {"a": {"entry": "envs.arithmetic:Arithmetic", "splits": {"train": {}}}}})
        self.sinks = MetricSinks(cfg, None, "prom-test")
        self.sinks.log(row)
        return True


def test_job_metrics_show_on_the_prometheus_endpoint(ray_local):
    holder = SinkHolder.remote()
    assert ray.get(holder.log.remote({"step": 3, "reward_mean": 0.625, "eval/arithmetic/accuracy": 0.5,
                                      "phase": "grpo"}))
    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    want = {"ray_otray_reward_mean": 0.625, "ray_otray_eval_arithmetic_accuracy": 0.5, "ray_otray_step": 3.0}
    seen: dict[str, float] = {}
    deadline = time.monotonic() + 60  # the agent exports on an interval (~5-10 s)
    while time.monotonic() < deadline and len(seen) < len(want):
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        for line in text.splitlines():
            name = line.split("{", 1)[0]
            if name in want and 'job="prom-test"' in line:
                seen[name] = float(line.rsplit(" ", 1)[1])
        time.sleep(1)
    assert seen == want
    ray.kill(holder)
