"""Several teachers (issue 40, part 1): the `teachers:` list, `teacher_route`, routing of prompt records and
per-teacher metrics. No models are built here (tests/test_multi_teacher_e2e.py runs them)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from megatron_opd.config import ConfigError, config_to_dict, dump_config, load_config
from megatron_opd.data.prompts import DataError, PromptRecord, PromptSet, route_teachers
from megatron_opd.trainer.batch import SequenceItem
from megatron_opd.trainer.step_metrics import batch_metrics, per_teacher, step_metrics

TWO = ["teachers=[{name: math, hf_path: /m/big}, {name: easy, backend: hf, hf_path: /m/small, temperature: 0.5}]",
       "teacher_route.field=teacher"]


def test_teachers_list_parses_and_the_first_stands_for_teacher(tmp_path):
    cfg_file = tmp_path / "two.yaml"
    cfg_file.write_text(yaml.safe_dump({
        "teachers": [{"name": "math", "hf_path": "/m/big", "top_k": 3},
                     {"name": "easy", "backend": "hf", "hf_path": "/m/small", "temperature": 0.5}],
        "teacher_route": {"field": "subject", "map": {"algebra": "math", "counting": "easy"}, "default": "easy"}}))
    cfg = load_config(cfg_file)
    assert [t.name for t in cfg.all_teachers()] == ["math", "easy"]
    assert [t.backend for t in cfg.teachers] == ["megatron", "hf"] and cfg.teachers[1].temperature == 0.5
    assert cfg.teacher is cfg.teachers[0] and cfg.teacher_key(1) == "teachers[1]"
    assert cfg.teacher_route.map == {"algebra": "math", "counting": "easy"}
    # dumped and read back (a run's config.yaml): the same teachers, and not `teacher:` beside `teachers:`
    dump_config(cfg, tmp_path / "dumped.yaml")
    assert "teacher" not in yaml.safe_load((tmp_path / "dumped.yaml").read_text())
    again = load_config(tmp_path / "dumped.yaml")
    assert config_to_dict(again) == config_to_dict(cfg)


def test_single_teacher_block_is_unchanged():
    cfg = load_config(None, ["teacher.hf_path=/m/t", "teacher.backend=hf"])
    assert cfg.teachers == [] and [t.name for t in cfg.all_teachers()] == ["default"]
    assert cfg.all_teachers()[0] is cfg.teacher and cfg.teacher_key(0) == "teacher"
    d = config_to_dict(cfg)
    assert "teachers" not in d and d["teacher"]["backend"] == "hf"
    with pytest.raises(ConfigError, match=r"^teacher.top_k: must be >= 0"):
        load_config(None, ["teacher.top_k=-1"])


@pytest.mark.parametrize("overrides,message", [
    (["teacher.hf_path=/m/t", "teachers=[{name: a}]"], r"^teacher, teachers: .*not both"),
    (["teachers=[{name: a}, {name: b}, {name: a}]", "teacher_route.default=a"], r"^teachers\[2\]\.name: duplicate"),
    (TWO + ["teacher_route.map={algebra: physics}"], r"^teacher_route\.map\.algebra: names no teacher: 'physics'"),
    (TWO + ["teacher_route.default=physics"], r"^teacher_route\.default: names no teacher: 'physics'"),
    (["teachers=[{name: a}, {name: b}]"], r"^teacher_route: 2 teachers but no teacher_route.field"),
    (["teachers=[{name: a}, {name: b}]", "teacher_route.default=a", "teacher_route.map={x: b}"],
     r"^teacher_route\.field: is not set"),
    (["teachers=[{name: a, bogus: 1}]"], r"^teachers\[0\]\.bogus: unknown key"),
    (["teachers=[{name: a}, {name: b, top_k: -2}]", "teacher_route.default=a"], r"^teachers\[1\]\.top_k: must be >= 0"),
    (["teachers=[{name: a, backend: sglang, server_url: 'http://h:1', temperature: 0.7}]"],
     r"^teachers\[0\]\.temperature: 0\.7 needs an in-process teacher"),
    (["teachers=[{name: a, temperature: 0}]"], r"^teachers\[0\]\.temperature: must be > 0"),
    (["teachers=[{name: 'a b'}]"], r"^teachers\[0\]\.name: must be a non-empty name"),
    (["teachers=[{name: a, top_k: 2}, {name: b, top_k: 4}]", "teacher_route.default=a", "algo.golden_loss=fkl_topk",
      "algo.preset=stable_opd"], r"^teachers\[1\]\.top_k: every teacher's top_k must be equal"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def _records(tmp_path, values):
    path = tmp_path / "prompts.jsonl"
    rows = [{"problem": f"p{i}", **({"teacher": v} if v is not None else {})} for i, v in enumerate(values)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recs = [PromptRecord(id=str(i), problem=r["problem"], prompt=r["problem"], prompt_ids=[1],
                         source=f"{path}:{i + 1}", meta={k: v for k, v in r.items() if k != "problem"})
            for i, r in enumerate(rows)]
    return PromptSet(recs, [], str(path)), path


def test_route_teachers_by_field_map_and_default(tmp_path):
    cfg = load_config(None, TWO + ["teacher_route.map={algebra: math}", "teacher_route.default=easy"])
    ps, _ = _records(tmp_path, ["math", "easy", "algebra", "unknown", None])
    route_teachers(ps, cfg.teacher_route, ["math", "easy"])
    assert [r.teacher for r in ps.records] == ["math", "easy", "math", "easy", "easy"]


def test_route_without_default_names_file_and_line(tmp_path):
    cfg = load_config(None, TWO)
    ps, path = _records(tmp_path, ["math", "physics"])
    with pytest.raises(DataError, match=rf"^{path}:2: teacher='physics' names no teacher .*teacher_route.default"):
        route_teachers(ps, cfg.teacher_route, ["math", "easy"])
    ps, path = _records(tmp_path, ["math", None])
    with pytest.raises(DataError, match=rf"^{path}:2: has no field 'teacher'"):
        route_teachers(ps, cfg.teacher_route, ["math", "easy"])


def test_one_teacher_takes_every_record(tmp_path):
    cfg = load_config(None, [])
    ps, _ = _records(tmp_path, [None, "anything"])
    route_teachers(ps, cfg.teacher_route, ["default"])
    assert [r.teacher for r in ps.records] == ["default", "default"]


def _rows():
    """Four rows of three tokens: rows 0 and 2 scored by teacher 0, rows 1 and 3 by teacher 1."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    return {"mask": mask, "ids": torch.arange(12).reshape(4, 3), "truncated": torch.tensor([True, False, False, False]),
            "golden": torch.zeros(4, dtype=torch.bool),
            "old_logp": -torch.ones(4, 3), "teacher_logp": -torch.tensor([[0.5] * 3, [2.0] * 3, [1.5] * 3, [3.0] * 3]),
            "teacher_id": torch.tensor([0, 1, 0, 1])}


def test_per_teacher_metrics_are_each_teachers_rows():
    rows = _rows()
    out = per_teacher(rows, ["math", "easy"], None)
    # A = teacher - old: math rows 0 (3 tokens of 0.5) and 2 (1 token of -0.5); easy rows 1 (2 x -1) and 3 (3 x -2)
    assert out["adv/mean/math"] == pytest.approx((3 * 0.5 - 0.5) / 4)
    assert out["adv/mean/easy"] == pytest.approx((2 * -1.0 + 3 * -2.0) / 5)
    assert out["rollout/truncation_rate/math"] == pytest.approx(0.5)
    assert out["rollout/truncation_rate/easy"] == 0.0
    whole = batch_metrics(rows, None)
    assert whole["adv/mean"] == pytest.approx((3 * 0.5 - 0.5 + 2 * -1.0 + 3 * -2.0) / 9)
    assert {k.rsplit("/", 1)[0] for k in out} == set(whole)  # every batch-wide metric, per teacher
    assert per_teacher(rows, ["math", "easy", "idle"], None).keys() == out.keys()  # no rows: not logged


def test_step_metrics_log_per_teacher_only_with_teachers():
    """Through `step_metrics` (one rank): the batch-wide names stay; `<name>` suffixes appear when the payload
    names the step's teachers (trainer/scoring.py, `teachers:` configured), text metrics included."""
    from megatron_opd.trainer.batch import build_batch

    items = [SequenceItem([1, 2], [3, 4, 5], truncated=i == 0, prompt_index=i, teacher=["math", "easy"][i % 2])
             for i in range(4)]
    batch = build_batch(items, 0)
    batch.extras.update(old_logp=-torch.ones(4, 3), teacher_logp=-2 * torch.ones(4, 3),
                        teacher_id=torch.tensor([0, 1, 0, 1]))
    payload = {"items": items, "texts": ["a b", "c", "d", "e"], "teacher": None}
    plain = step_metrics(batch, payload, [], reports=True, rank=0, off_policy=True, config=None)
    assert "adv/mean" in plain and not any(k.endswith(("/math", "/easy")) for k in plain)
    named = step_metrics(batch, {**payload, "teacher_names": ["math", "easy"]}, [], reports=True, rank=0,
                         off_policy=True, config=None)
    assert named["rollout/truncation_rate"] == 0.25
    assert named["rollout/truncation_rate/math"] == 0.5 and named["rollout/truncation_rate/easy"] == 0.0
    assert named["adv/mean/math"] == named["adv/mean/easy"] == named["adv/mean"] == pytest.approx(-1.0)


def test_plan_counts_every_in_process_teacher():
    """megatron_opd.plan: a second megatron teacher's weights on every trainer rank and an hf teacher's on
    rank 0 (the plan counted only `teacher`, i.e. teachers[0])."""
    from megatron_opd.plan import GPUS, Cluster, arch_from, plan_run, stage_params

    base = ["model.hf_path=/models/Qwen2.5-Math-1.5B", "teacher_route.default=big"]
    one = load_config(None, base + ["teachers=[{name: big, hf_path: /models/OpenThinker3-7B, params_dtype: bfloat16}]"])
    two = load_config(None, base + [
        "teachers=[{name: big, hf_path: /models/OpenThinker3-7B, params_dtype: bfloat16}, "
        "{name: small, hf_path: /models/Qwen2.5-Math-1.5B, params_dtype: bfloat16}, "
        "{name: side, backend: hf, hf_path: /models/Qwen2.5-Math-1.5B, params_dtype: bfloat16}]"])
    s, t = arch_from("/models/Qwen2.5-Math-1.5B", "m"), arch_from("/models/OpenThinker3-7B", "t")
    r1, r2 = (plan_run(c, Cluster(GPUS["h100-80gb"], 1), s, t)["ranks"][0] for c in (one, two))
    parts = {c["name"]: c for c in r2["components"]}
    assert parts["teacher 'small' weights (in-process)"]["gb"] * 1e9 == pytest.approx(stage_params(s, 1, 1, "only") * 2)
    assert parts["teacher 'side' (HF, rank 0)"]["gb"] * 1e9 == pytest.approx(s.params * 2)
    assert parts["teacher 'side' (HF, rank 0)"]["rank0"]
    held = [sum(c["gb"] for c in r["components"] if c["phase"] == "" and c["name"] != "allocator slack")
            for r in (r1, r2)]
    assert held[1] == pytest.approx(held[0] + (stage_params(s, 1, 1, "only") + s.params) * 2 / 1e9)
    assert r2["total_gb"] > r1["total_gb"] + held[1] - held[0] - 1e-9
