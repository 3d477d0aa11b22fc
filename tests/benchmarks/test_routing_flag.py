"""Every decode, prefill and serve benchmark takes --routing (a generated profile, or the model's
own router), keeps the routing it ran under before as its default, and names the routing in
its table's notes and, off the default, in a section of its own."""

import importlib

import pytest

from benchmarks.common import MODEL_ROUTING, routed_section, routing_choices, routing_note

DEFAULTS = {"bench_decode": MODEL_ROUTING, "bench_ttft": MODEL_ROUTING, "bench_serve": MODEL_ROUTING,
            "bench_deepseek": MODEL_ROUTING, "bench_gpt_oss": MODEL_ROUTING, "bench_structured": MODEL_ROUTING,
            "bench_prefill": "uniform", "bench_quant": "uniform", "bench_hybrid": "uniform"}


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_each_benchmark_takes_routing_with_its_former_routing_as_default(name):
    bench = importlib.import_module(f"benchmarks.{name}")
    assert bench.parse_args([]).routing == DEFAULTS[name]
    args = bench.parse_args(["--routing", "qwen3", "--routing-seed", "3"])
    assert (args.routing, args.routing_seed) == ("qwen3", 3)
    with pytest.raises(SystemExit):
        bench.parse_args(["--routing", "zipf"])


def test_the_choices_are_the_profiles_and_the_models_own_router():
    assert routing_choices() == ["uniform", "qwen3", "mixtral", MODEL_ROUTING]


def test_a_table_off_its_default_routing_gets_a_section_of_its_own_and_says_why():
    assert routed_section("hybrid/decode", "uniform") == "hybrid/decode"
    assert routed_section("hybrid/decode", "qwen3") == "hybrid/decode/qwen3"
    assert routed_section("decode", MODEL_ROUTING, MODEL_ROUTING) == "decode"
    note = routing_note("qwen3", 5)
    assert "qwen3" in note and "45% reuse" in note and "seed 5" in note
    assert "own router" in routing_note(MODEL_ROUTING)


def test_bench_uva_and_sampling_take_generated_routings_too():
    from benchmarks import bench_sampling, bench_uva

    assert bench_uva.parse_args(["--routings", "uniform", "qwen3"]).routings == ["uniform", "qwen3"]
    assert bench_sampling.parse_args(["--routings", "mixtral", "dummy"]).routings == ["mixtral", "dummy"]
