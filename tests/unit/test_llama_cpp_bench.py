"""benchmarks/llama_cpp_bench.py without llama.cpp: its parsing of llama-batched-bench output recorded on the bench
host, the table's cells, the side-by-side rendering and the greedy-token comparison."""

from __future__ import annotations

import pytest

from benchmarks.llama_cpp_bench import (
    NOT_IN_TREE,
    agreement,
    llama_cpp_figures,
    median_rows,
    parse_batched_bench,
    pdserve_figures,
    pdserve_system,
    render_table,
    table_rows,
)

# llama-batched-bench's stdout, recorded (F32 GGUF of the small demo, 2 threads, a loaded host; the decode run was
# stopped before its 32-sequence row)
SETTINGS_LINE = (
    "llama_batched_bench: n_kv_max = {kv}, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, "
    "is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2"
)
HEADER = """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
"""
PREFILL_OUT = (
    "\n"
    + SETTINGS_LINE.format(kv=1024)
    + "\n"
    + HEADER
    + "|   512 |      1 |    1 |    513 |    1.602 |   319.61 |    0.075 |    13.37 |    1.677 |   305.94 |\n\n"
)
DECODE_OUT = (
    "\n"
    + SETTINGS_LINE.format(kv=8192)
    + "\n"
    + HEADER
    + "|   128 |    128 |    1 |    256 |    0.421 |   304.33 |    6.204 |    20.63 |    6.625 |    38.64 |\n"
    + "|   128 |    128 |    8 |   2048 |    1.983 |   516.33 |   31.207 |    32.81 |   33.190 |    61.71 |\n"
)
# a run that printed the header and no row (it happened once on a loaded host)
ROWLESS_OUT = "\n" + SETTINGS_LINE.format(kv=1024) + "\n" + HEADER


def test_parse_reads_the_settings_and_every_row() -> None:
    settings, rows = parse_batched_bench(DECODE_OUT)
    assert settings["n_threads"] == settings["n_threads_batch"] == 2
    assert settings["flash_attn"] == -1 and settings["n_kv_max"] == 8192
    assert [(r["pp"], r["tg"], r["b"], r["n_kv"]) for r in rows] == [(128, 128, 1, 256), (128, 128, 8, 2048)]
    assert rows[1]["s_tg"] == pytest.approx(32.81) and rows[1]["t_pp"] == pytest.approx(1.983)
    assert rows[0] == pytest.approx(
        dict(pp=128, tg=128, b=1, n_kv=256, t_pp=0.421, s_pp=304.33, t_tg=6.204, s_tg=20.63, t=6.625, s=38.64)
    )


def test_parse_ignores_log_lines_and_refuses_a_rowless_run() -> None:
    noisy = "llama_model_loader: - kv  21: tokenizer.ggml.model str = gpt2\n| not | a | row |\n" + PREFILL_OUT
    _, rows = parse_batched_bench(noisy)
    assert len(rows) == 1 and rows[0]["s_pp"] == pytest.approx(319.61)
    with pytest.raises(ValueError, match="no result rows"):
        parse_batched_bench(ROWLESS_OUT)


def test_median_rows_takes_each_fields_median_over_runs() -> None:
    _, rows = parse_batched_bench(DECODE_OUT)
    faster = [r | dict(s_tg=r["s_tg"] * 2, t_tg=r["t_tg"] / 2) for r in rows]
    slower = [r | dict(s_tg=r["s_tg"] / 2, t_tg=r["t_tg"] * 2) for r in rows]
    out = median_rows([slower, rows, faster])
    assert [(r["pp"], r["tg"], r["b"]) for r in out] == [(128, 128, 1), (128, 128, 8)]
    assert out[0]["s_tg"] == pytest.approx(20.63) and out[1]["t_tg"] == pytest.approx(31.207)
    assert out[1]["s_tg_runs"] == pytest.approx([32.81 / 2, 32.81, 32.81 * 2])
    with pytest.raises(ValueError, match="missing"):
        median_rows([rows, rows[:1]])


def test_llama_cpp_cells_come_from_the_matching_rows() -> None:
    _, prefill = parse_batched_bench(PREFILL_OUT)
    _, decode = parse_batched_bench(DECODE_OUT)
    cells = llama_cpp_figures(prefill, decode)
    # prefill is S_PP of the 512-token prompt; decode is S_TG; the stopped run has no 32-sequence row
    assert cells == pytest.approx(dict(prefill=319.61, decode_1=20.63, decode_8=32.81, decode_32=None))
    # the decode run's prompt-phase speed is not a prefill figure
    assert llama_cpp_figures([], decode)["prefill"] is None


def _engine_report(prefill_len: int = 512) -> dict:
    system = "pdserve_cpukernel"
    return {
        "config": dict(
            prefill_len=prefill_len, decode_prompt_len=128, decode_tokens=128, systems=[system, "transformers"]
        ),  # fmt: skip
        "prefill": [
            {"batch": 1, f"{system}_tok_s": 2490.0, "transformers_tok_s": 1.0},
            {"batch": 8, f"{system}_tok_s": 3000.0, "transformers_tok_s": 1.0},
        ],  # fmt: skip
        "decode": [
            {"batch": b, f"{system}_tok_s": v, "transformers_tok_s": 1.0}
            for b, v in ((1, 107.0), (8, 476.0), (32, 1142.0))
        ],  # fmt: skip
    }


def test_pdserve_cells_are_the_headline_systems_batch_1_prefill_and_decode_rows() -> None:
    cells = pdserve_figures(_engine_report())
    assert cells == dict(prefill=2490.0, decode_1=107.0, decode_8=476.0, decode_32=1142.0)
    with pytest.raises(ValueError, match="prefill/prompt/tokens"):
        pdserve_figures(_engine_report(prefill_len=256))
    with pytest.raises(ValueError, match="no pdserve system with int8"):
        pdserve_figures(_engine_report(), "int8")  # a run without --dtype has float32 only


def test_each_dtype_reads_its_own_system_of_a_dtype_run() -> None:
    systems = ["pdserve_cpukernel@float32", "pdserve_cpukernel@bfloat16", "pdserve_cpukernel@int8", "transformers"]
    assert pdserve_system(systems, "bfloat16") == "pdserve_cpukernel@bfloat16"
    assert pdserve_system(systems[:1] + systems[-1:], "int8") is None
    assert pdserve_system(["pdserve_cpukernel", "transformers"], "float32") == "pdserve_cpukernel"
    report = _engine_report()
    report["config"]["systems"] = systems
    for row in report["prefill"] + report["decode"]:
        row["pdserve_cpukernel@float32_tok_s"] = row.pop("pdserve_cpukernel_tok_s")
        row["pdserve_cpukernel@bfloat16_tok_s"] = 2 * row["pdserve_cpukernel@float32_tok_s"]
        row["pdserve_cpukernel@int8_tok_s"] = 3 * row["pdserve_cpukernel@float32_tok_s"]
    assert pdserve_figures(report, "int8") == dict(prefill=7470.0, decode_1=321.0, decode_8=1428.0, decode_32=3426.0)
    assert pdserve_figures(report, "float32")["decode_32"] == 1142.0


def test_agreement_counts_leading_and_positional_matches() -> None:
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == dict(tokens=4, leading_same=4, same=4, identical=True)
    assert agreement([1, 2, 3, 4], [1, 2, 9, 4]) == dict(tokens=4, leading_same=2, same=3, identical=False)
    assert agreement([1, 2, 3, 4], [7, 2, 3, 4])["leading_same"] == 0
    short = agreement([1, 2, 3, 4], [1, 2])
    assert short["leading_same"] == 2 and not short["identical"]


def test_table_puts_the_systems_side_by_side_with_ratios_and_reasons() -> None:
    peer = dict(prefill=1257.0, decode_1=228.0, decode_8=463.0, decode_32=844.0)
    ours = dict(prefill=2490.0, decode_1=107.0, decode_8=476.0, decode_32=None)
    q8 = dict(prefill=1352.0, decode_1=534.0, decode_8=676.0, decode_32=1005.0)
    rows = table_rows({"float32": {"llama.cpp": peer, "pdserve": ours},
                       "int8": {"llama.cpp": q8, "pdserve": NOT_IN_TREE, "llama.cpp flags": "-nr"}})  # fmt: skip
    assert render_table(rows).splitlines() == [
        "| weights | system | prefill (512) | decode, 1 seq | decode, 8 seqs | decode, 32 seqs |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
        "| float32 | llama.cpp | 1257 | 228 | 463 | 844 |",
        "| float32 | pdserve | 2490 | 107 | 476 | - |",
        "| float32 | pdserve / llama.cpp | 1.98x | 0.47x | 1.03x | - |",
        "| int8 | llama.cpp (Q8_0, -nr) | 1352 | 534 | 676 | 1005 |",
        f"| int8 | pdserve | {NOT_IN_TREE} |  |  |  |",
    ]
