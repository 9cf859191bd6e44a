"""The Serve app on a local Ray: the official openai client (chat, completions, streaming),
raw HTTP for the error cases, a trained checkpoint served by name, API keys."""

import json
import time
from pathlib import Path

import pytest
from tests.conftest import SERVE_PORT, fresh_resource_manager, kill_resource_manager

from tests.conftest import ROOT  # noqa: E402 (the repository root)
PORT = SERVE_PORT  # (tests/conftest.py: Serve is started once per pytest process)


def _post(path, body, key=None, raw=None):
    import httpx

    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(f"http://127.0.0.1:{PORT}{path}", content=content, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def served(ray_local, tmp_path_factory, tiny_path):
    """A ResourceManager with auth on, one user, one finished SFT job with a checkpoint, and the app."""
    from ray import serve

    from otray import config
    from otray.serve import config as serve_config
    from otray.serve.app import APP_NAME, run

    tmp = tmp_path_factory.mktemp("serve")
    rm = fresh_resource_manager(tmp / "registry.db", auth_enabled=True)
    alice = ray_local.get(rm.add_user.remote("alice"))
    bob = ray_local.get(rm.add_user.remote("bob", False, alice))
    job_cfg = config.to_dict(config.load(ROOT / "conf" / "arithmetic_grpo.yaml", [
        "sft.steps=30", "sft.stop_at_accuracy=null", "algo.steps=2", "algo.batch_size=4", "eval.num_samples=2",
        f"job.output_dir={tmp}/runs", f"model.path={tiny_path}", f"envs.arithmetic.dataset.dir={tmp}/data"]))
    job_id = ray_local.get(rm.submit.remote(job_cfg, alice))
    deadline = time.time() + 300
    while ray_local.get(rm.status.remote(job_id, alice)).state not in ("SUCCEEDED", "FAILED", "CANCELLED"):
        assert time.time() < deadline, "the training job did not finish"
        time.sleep(0.5)
    assert ray_local.get(rm.status.remote(job_id, alice)).state == "SUCCEEDED"
    cfg = serve_config.load_serve({"port": PORT, "request_timeout_s": 60, "max_n": 4, "max_tokens": 64,
                             "models": [{"name": "tiny", "path": tiny_path, "max_loaded_checkpoints": 1}]})
    run(cfg)
    yield {"alice": alice, "bob": bob, "job": job_id}
    serve.delete(APP_NAME)  # Serve stays up for the next module (tests/conftest.py SERVE_PORT)
    kill_resource_manager()


def _client(key):
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key=key, max_retries=0, timeout=60)


def test_openai_client_chat_completions_and_streaming(served):
    client = _client(served["alice"])
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == "tiny" and f"job-{served['job']}" in ids
    messages = [{"role": "user", "content": "What is 12+30?"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    choice = chat.choices[0]
    assert chat.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    assert chat.usage.prompt_tokens > 5 and 1 <= chat.usage.completion_tokens <= 12
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    # streamed greedy text is the same text, delivered in several chunks, then [DONE]
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == choice.message.content and len([p for p in pieces if p]) >= 2
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    # completions, n > 1 sampled with a seed, length limit reported
    comp = client.completions.create(model="tiny", prompt="1+1=", max_tokens=5, temperature=1.0, n=3, seed=7,
                                     extra_body={"stop": ["\n\n\n"]})
    assert comp.object == "text_completion" and len(comp.choices) == 3 and [c.index for c in comp.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in comp.choices)
    text_stream = list(client.completions.create(model="tiny", prompt="1+1=", max_tokens=6, temperature=0, stream=True))
    greedy = client.completions.create(model="tiny", prompt="1+1=", max_tokens=6, temperature=0)
    assert "".join(c.choices[0].text for c in text_stream) == greedy.choices[0].text


def test_concurrent_streams_and_a_trained_checkpoint_stream_their_complete_answers(served):
    """Four clients stream greedy chats at once (the replica decodes them in turns, together where they wait
    together) and one streams the trained checkpoint: each streamed text is that model's complete answer."""
    assert _streamed_and_whole(_client(served["alice"]), served["job"]) == (True, True)


def _streamed_and_whole(client, job) -> tuple[bool, bool]:
    """Four greedy chats of the base model and one of the job's checkpoint, complete one by one, then streamed at
    once: whether each streamed text (and finish reason) is its complete answer, and whether the base model's
    answers differ from one another (so the check could fail)."""
    from concurrent.futures import ThreadPoolExecutor

    asks = [("tiny", f"What is {i}+{i * 5}?") for i in range(4)] + [(f"job-{job}", "What is 7+8?")]

    def chat(model, text, stream):
        got = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                             max_tokens=24, temperature=0, stream=stream)
        if not stream:
            return got.choices[0].message.content, got.choices[0].finish_reason
        chunks = [c for c in got if c.choices]
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason

    whole = [chat(model, text, False) for model, text in asks]
    with ThreadPoolExecutor(len(asks)) as pool:
        streamed = list(pool.map(lambda a: chat(*a, True), asks))
    return streamed == whole, len({w for w in whole[:4]}) > 1


def test_a_trained_checkpoint_answers_differently_from_the_base(served):
    client = _client(served["alice"])
    messages = [{"role": "user", "content": "What is 23+45?"}]
    base = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    tuned = client.chat.completions.create(model=f"job-{served['job']}", messages=messages, max_tokens=8,
                                           temperature=0)
    pinned = [m.id for m in client.models.list().data if m.id.startswith(f"job-{served['job']}:")][-1]
    again = client.chat.completions.create(model=pinned, messages=messages, max_tokens=8, temperature=0)
    assert tuned.choices[0].message.content != base.choices[0].message.content
    assert again.choices[0].message.content == tuned.choices[0].message.content  # job-<id> = its latest step
    assert tuned.model == f"job-{served['job']}"


@pytest.mark.parametrize("path, body, raw, status, param", [
    ("/v1/chat/completions", None, b"{not json", 400, None),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, None, 404, "model"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
     None, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 50},
     None, 400, "n"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "7 " * 600}]},
     None, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, None, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tempurature": 1},
     None, 400, "tempurature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}, None, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 2_000_000}, None, 413, None),
    ("/v1/completions", {"model": "job-20990101-000000-abcdef", "prompt": "x"}, None, 404, "model"),
    ("/v1/nothing", {}, None, 404, None),
    ("/v1/completions", None, b"[" * 1000 + b"]" * 1000, 400, None),  # nested 1,000 deep
    ("/v1/completions", None, b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
])
def test_bad_requests_get_a_4xx_with_an_openai_error_body(served, path, body, raw, status, param):
    r = _post(path, body, served["alice"], raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param


def test_huge_prompts_and_indexes_are_refused_cheaply(served):
    """A prompt far past the token limit is refused before tokenizing (< 50 ms, not seconds); query
    indexes past SQLite's integers are a 400, and another user's job is the same 404 as none."""
    import httpx

    body = {"model": "tiny", "prompt": "12+34=" * 160_000}  # ~960 KB: under the body limit
    _post("/v1/completions", {"model": "tiny", "prompt": "1+1=", "max_tokens": 1}, served["alice"])  # warm
    def timed(**kw):
        t0 = time.perf_counter()
        r = _post("/v1/completions", key=served["alice"], **kw)
        return r, time.perf_counter() - t0

    took, floor = [], []
    for _ in range(3):  # against the same-size body refused at the JSON parse: what moving ~1 MB costs
        r, t = timed(body=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        took.append(t)
        floor.append(timed(body=None, raw=b"{" + b" " * len(json.dumps(body)))[1])
    assert min(took) - min(floor) < 0.05, (took, floor)  # refused within 50 ms of reading the body
    auth = {"authorization": f"Bearer {served['alice']}"}
    base = f"http://127.0.0.1:{PORT}/api/jobs/{served['job']}"
    for url, param in ((f"{base}/metrics?since=99999999999999999999", "since"),
                       (f"{base}/episodes?step=99999999999999999999", "step")):
        r = httpx.get(url, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    bob = {"authorization": f"Bearer {served['bob']}"}
    mine, none = httpx.get(base, headers=bob), httpx.get(f"http://127.0.0.1:{PORT}/api/jobs/20990101-000000-abcdef",
                                                          headers=bob)
    assert mine.status_code == none.status_code == 404
    assert mine.json()["error"]["message"].replace(served["job"], "X") == \
        none.json()["error"]["message"].replace("20990101-000000-abcdef", "X")


def test_api_keys(served):
    import httpx

    body = {"model": "tiny", "prompt": "1+1=", "max_tokens": 2}
    for key in (None, "otr_1_wrong", "garbage"):
        r = _post("/v1/completions", body, key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (key, r.text)
    assert _post("/v1/completions", body, served["bob"]).status_code == 200
    # bob sees and may use only his own jobs: alice's checkpoint does not exist for him
    bob_models = httpx.get(f"http://127.0.0.1:{PORT}/v1/models", headers={"authorization": f"Bearer {served['bob']}"})
    assert [m["id"] for m in bob_models.json()["data"]] == ["tiny"]
    r = _post("/v1/completions", {**body, "model": f"job-{served['job']}"}, served["bob"])
    assert r.status_code == 404 and "do not have access" in r.json()["error"]["message"]
    assert httpx.get(f"http://127.0.0.1:{PORT}/health").json() == {"status": "ok"}


def test_dashboard_in_headless_chromium(served, ray_local, tmp_path, tiny_path):
    import shutil

    from playwright.sync_api import sync_playwright

    from envs.shapes import draw, scene
    from otray import config
    from otray.actors.control.resource_manager import get_or_create
    from otray.actors.job.episodes import logged_images
    from otray.types import Task, Trajectory

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium is missing: `make test` installs it (apt-get install chromium)"
    rm = get_or_create()
    long_job = config.to_dict(config.load(ROOT / "conf" / "arithmetic_sft.yaml", [
        "sft.steps=100000", "eval.num_samples=2", "sft.eval_samples=4", f"job.output_dir={tmp_path}/runs",
        f"model.path={tiny_path}", f"sft.dataset.dir={tmp_path}/data", "envs.arithmetic.dataset.dir=" + str(tmp_path / "d")]))
    running = ray_local.get(rm.submit.remote(long_job, served["alice"]))
    deadline = time.time() + 120
    while ray_local.get(rm.status.remote(running, served["alice"])).state != "RUNNING":
        assert time.time() < deadline
        time.sleep(0.3)
    problems = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.on("dialog", lambda d: d.accept())  # the cancel button asks for confirmation
        page.add_init_script(f"localStorage.setItem('otray-key', '{served['alice']}')")
        page.goto(f"http://127.0.0.1:{PORT}/dashboard")
        page.wait_for_selector(f"tr[data-id='{running}']", timeout=30_000)
        listed = page.eval_on_selector_all("#jobs tbody tr", "rows => rows.map(r => r.dataset.id)")
        assert running in listed and served["job"] in listed
        # the finished job: curves, checkpoints and its logged episodes
        page.click(f"tr[data-id='{served['job']}']")
        page.wait_for_selector("#checkpoints li", timeout=15_000)
        assert f"job-{served['job']}:" in page.inner_text("#checkpoints")
        try:
            page.wait_for_selector("#chart-reward polyline", state="attached", timeout=15_000)
        except Exception as e:
            raise AssertionError(f"{page.inner_text('#status')} / {problems}") from e
        page.wait_for_selector("#episodes .episode .turn.assistant", timeout=15_000)  # the trajectory viewer
        # an SFT job has no Elo table; a game job's elo/<player> rows draw one line per player
        assert page.is_hidden("#figure-elo")
        drawn = page.evaluate("""() => { const svg = document.getElementById('chart-elo');
            chart(svg, prefixedLines([{step: 0, 'elo/main': 1000, 'elo/random': 1000, reward_mean: 0.1},
                                      {step: 5, 'elo/main': 1100, 'elo/heuristic': 1200}], KEYS.elo_prefix));
            return [...svg.querySelectorAll('polyline')].map(p => [p.dataset.name, p.getAttribute('points').split(' ').length]); }""")
        assert drawn == [["heuristic", 1], ["main", 2], ["random", 1]]
        # a visual env's logged episode: each <image> marker shows the next logged picture, decoded by the
        # browser; a marker past the logged ones (too large to log) stays as text
        traj = Trajectory(task=Task(id="t", env="count_shapes"), images=[draw(scene(s)[1]) for s in range(2)],
                          messages=[{"role": "user", "content": "<image> and <image> and <image>: how many?"}])
        episode = {"env": "count_shapes", "task": "t", "reward": 1.0, "advantage": 0.5, "messages": traj.messages,
                   **logged_images(traj)}
        shown = page.evaluate("""async (e) => { const div = turns(e)[0];
            await Promise.all([...div.querySelectorAll('img')].map(i => i.decode()));
            return [[...div.querySelectorAll('img')].map(i => [i.naturalWidth, i.src.slice(0, 22)]), div.textContent]; }""",
                              episode)
        assert shown == [[[56, "data:image/png;base64,"], [56, "data:image/png;base64,"]],
                         "user:  and  and <image>: how many?"], shown
        assert "advantage" in page.inner_text("#episodes .episode .meta")
        page.click(f"button.cancel[data-id='{running}']")
        deadline = time.time() + 30
        while ray_local.get(rm.status.remote(running, served["alice"])).state != "CANCELLED":
            assert time.time() < deadline, "the cancel button did not cancel the job"
            time.sleep(0.3)
        page.wait_for_selector(f"tr[data-id='{running}'] .state-CANCELLED", timeout=15_000)
        shots = ROOT / ".cache" / "screenshots"
        shots.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shots / "dashboard.png"), full_page=True)
        browser.close()
    assert problems == [], problems
    assert (ROOT / ".cache" / "screenshots" / "dashboard.png").stat().st_size > 10_000


def _answers(key, job):
    """Greedy answers of the base model and of the job's checkpoint, complete and streamed."""
    client, prompt = _client(key), [{"role": "user", "content": "What is 31+27?"}]
    out = {}
    for model in ("tiny", f"job-{job}"):
        done = client.chat.completions.create(model=model, messages=prompt, max_tokens=8, temperature=0)
        stream = client.chat.completions.create(model=model, messages=prompt, max_tokens=8, temperature=0, stream=True)
        out[model] = (done.choices[0].message.content, "".join(c.choices[0].delta.content or "" for c in stream))
    return out


def test_split_and_single_layouts_answer_alike(served, tiny_path):
    """layout: single (the default with one base model: the Gateway generates in process) and
    layout: split (Gateway -> ModelServer deployment, checkpoints multiplexed by Serve) give the
    same greedy answers, complete and streamed, for the base model and a checkpoint."""
    from ray import serve

    from otray.serve import config as serve_config
    from otray.serve.app import run

    def deploy(layout):
        run(serve_config.load_serve({"port": PORT, "request_timeout_s": 60, "max_n": 4, "max_tokens": 64, "layout": layout,
                               "models": [{"name": "tiny", "path": tiny_path, "max_loaded_checkpoints": 1}]}))
        return {d for d in serve.status().applications["otray"].deployments}

    assert deploy("auto") == {"Gateway"}  # what the module's other tests ran against
    single = _answers(served["alice"], served["job"])
    assert deploy("split") == {"Gateway", "model-tiny"}
    split = _answers(served["alice"], served["job"])
    assert split == single
    assert single["tiny"][0] != single[f"job-{served['job']}"][0]
    for complete, streamed in single.values():
        assert complete == streamed


@pytest.mark.vllm
def test_a_vllm_model_streams_its_complete_answers_over_http(served, tiny_path):
    """A vLLM base model and a trained checkpoint on it (each a vLLM engine whose requests the replica's engine
    loop batches continuously): concurrent greedy streams over HTTP equal their complete answers."""
    from otray.serve import config as serve_config
    from otray.serve.app import run

    run(serve_config.load_serve({"port": PORT, "request_timeout_s": 60, "max_n": 4, "max_tokens": 64,
                                 "models": [{"name": "tiny", "path": tiny_path, "backend": "vllm", "max_model_len": 256,
                                             "max_loaded_checkpoints": 1}]}))
    assert _streamed_and_whole(_client(served["alice"]), served["job"]) == (True, True)


def test_without_a_manager_the_app_fails_closed(served):
    """auth: auto with no ResourceManager (killed for good, not restarting) answers 503, never an
    unauthenticated completion; the base model and a checkpoint are both refused."""
    kill_resource_manager()
    time.sleep(11)  # past the Gateway's cached manager handle and auth setting
    for key in (None, served["alice"]):
        for model in ("tiny", f"job-{served['job']}"):
            r = _post("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "1+1"}],
                                               "max_tokens": 2}, key)
            assert r.status_code == 503, (key, model, r.text)
            assert r.json()["error"]["code"] == "service_unavailable"
