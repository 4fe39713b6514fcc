"""The contract: what a valid spec is, and how a bad one is refused (naming field and value)."""

import pytest

from airflow_provider_rayllm.contract.spec import JobSpec, SpecError, hf_dataset, map_guide_flags, parse_spec


def body(**overrides):
    spec = {
        "source": {"uris": "/data/in.jsonl"},
        "prompt": {"prompt_column": "prompt", "sampling_params": {"max_tokens": 8}},
        "processor": {"model_source": "/models/smol"},
        "sink": {"uri": "/out/run1/"},
    }
    for key, value in overrides.items():
        section, _, field = key.partition("__")
        if field:
            spec[section] = {**spec[section], field: value}
        else:
            spec[section] = value
    return spec


def test_minimal_spec_fills_defaults_and_infers_format():
    spec = parse_spec(body())
    assert spec.source.uris == ["/data/in.jsonl"]
    assert spec.source.format == "jsonl"
    assert spec.sink.uri == "/out/run1"  # trailing slash dropped: one canonical prefix
    assert spec.processor.task_type == "generate"
    assert spec.limits.max_error_fraction == 0.1


def test_json_round_trip_is_identical():
    spec = parse_spec(body())
    assert parse_spec(spec.to_json()) == spec


def test_unknown_key_is_named():
    with pytest.raises(SpecError, match=r"processor\.engine_kwarg: unknown setting"):
        parse_spec(body(processor__engine_kwarg={"x": 1}))


def test_wrong_type_names_field_and_value():
    with pytest.raises(SpecError, match=r"processor\.batch_size.*'many'"):
        parse_spec(body(processor__batch_size="many"))


@pytest.mark.parametrize("uri", ["ftp://host/file.jsonl", "http://x/y.parquet", ""])
def test_bad_input_uri_is_refused(uri):
    with pytest.raises(SpecError, match="source.uris"):
        parse_spec(body(source={"uris": uri, "format": "jsonl"}))


@pytest.mark.parametrize(
    "uri, repo",
    [
        (
            "hf://datasets/lmms-lab/LMMs-Eval-Lite/coco2017_cap_val/",
            ("lmms-lab/LMMs-Eval-Lite", None, "coco2017_cap_val"),
        ),
        ("hf://datasets/org/name@v1.0/data/*.parquet", ("org/name", "v1.0", "data/*.parquet")),
        ("hf://datasets/org/name", ("org/name", None, "")),
    ],
)
def test_a_hugging_face_dataset_uri_is_an_input(uri, repo):
    spec = parse_spec(body(source={"uris": uri}))
    assert spec.source.uris == [uri]
    assert hf_dataset(uri) == repo


@pytest.mark.parametrize(
    "uri, says",
    [
        ("hf://lmms-lab/LMMs-Eval-Lite/coco2017_cap_val/", "names a model repo"),
        ("hf://models/org/name/x.parquet", "names a model repo"),
        ("hf://spaces/org/app/x.csv", "names a Space"),
        ("hf://buckets/org/b/x.parquet", "names a storage bucket"),
        ("hf://datasets/org", "names no dataset"),
        ("hf://datasets/org/@v1/x", "names no dataset"),
        ("hf://", "names no dataset"),
    ],
)
def test_a_hugging_face_uri_that_is_no_dataset_is_refused_naming_it(uri, says):
    with pytest.raises(SpecError) as exc:
        parse_spec(body(source={"uris": uri}))
    assert f"input_uri {uri!r} {says}" in str(exc.value) and "hf://datasets/<org>/<name>/<path>" in str(exc.value)


def test_the_hub_is_read_only():
    with pytest.raises(SpecError, match=r"output_uri 'hf://datasets/org/out': hf:// is read only"):
        parse_spec(body(sink={"uri": "hf://datasets/org/out"}))


def test_format_is_inferred_from_names_or_left_to_the_job():
    assert parse_spec(body(source={"uris": ["/a/x.parquet", "s3://b/y.parquet"]})).source.format == "parquet"
    assert parse_spec(body(source={"uris": "/data/folder"})).source.format is None
    assert parse_spec(body(source={"uris": ["/a.csv", "/b.jsonl"]})).source.format is None
    assert parse_spec(body(source={"uris": "/data/folder", "format": "parquet"})).source.format == "parquet"


def test_exactly_one_way_to_build_prompts():
    with pytest.raises(SpecError, match="exactly one of"):
        parse_spec(body(prompt={"prompt_column": "a", "template": "{b}"}))
    with pytest.raises(SpecError, match="exactly one of"):
        parse_spec(body(prompt={"sampling_params": {}}))


def test_template_columns_and_positional_fields():
    spec = parse_spec(body(prompt={"template": "Q: {question} ctx {doc[title]}"}))
    assert spec.prompt.required_columns() == ["doc", "question"]
    with pytest.raises(SpecError, match="positional field"):
        parse_spec(body(prompt={"template": "Q: {}"}))
    with pytest.raises(SpecError, match="not a valid format string"):
        parse_spec(body(prompt={"template": "Q: {unclosed"}))


def test_reserved_output_column():
    with pytest.raises(SpecError, match="reserved"):
        parse_spec(body(prompt__output_column="error"))


def test_bundles_must_match_tensor_times_pipeline_parallel():
    engine = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}
    with pytest.raises(SpecError, match=r"3 bundle\(s\).*2 x 2 = 4"):
        parse_spec(
            body(processor__engine_kwargs=engine, processor__placement_group_config={"bundles": [{"GPU": 1}] * 3})
        )
    ok = parse_spec(
        body(
            processor__engine_kwargs=engine,
            processor__placement_group_config={"bundles": [{"GPU": 1}] * 4, "strategy": "STRICT_PACK"},
        )
    )
    assert ok.processor.gpus_per_replica() == 4


def test_placement_strategy_and_keys():
    with pytest.raises(SpecError, match="'TIGHT' is not one of"):
        parse_spec(body(processor__placement_group_config={"bundles": [{"CPU": 1}], "strategy": "TIGHT"}))
    with pytest.raises(SpecError, match="unknown key"):
        parse_spec(body(processor__placement_group_config={"bundles": [{"CPU": 1}], "nodes": 2}))


@pytest.mark.parametrize("value", [0, (3, 2), (0, 1)])
def test_concurrency_bounds(value):
    with pytest.raises(SpecError, match="concurrency"):
        parse_spec(body(processor__concurrency=value))


def test_concurrency_range_accepted():
    assert parse_spec(body(processor__concurrency=[1, 4])).processor.concurrency == (1, 4)


def test_task_type_choices():
    with pytest.raises(SpecError, match="task_type"):
        parse_spec(body(processor__task_type="translate"))


def test_content_hash_ignores_run_but_not_settings():
    a = parse_spec({**body(), "run": {"dag_id": "d", "run_id": "r1", "try_number": 1}})
    b = parse_spec({**body(), "run": {"dag_id": "d", "run_id": "r1", "try_number": 2}})
    c = parse_spec(body(prompt__sampling_params={"max_tokens": 9}))
    assert a.content_hash() == b.content_hash()
    assert a.content_hash() != c.content_hash()


def test_guide_flags_map_to_stage_configs():
    mapped = map_guide_flags({"apply_chat_template": False, "detokenize": False, "has_image": True, "tokenize": True})
    assert mapped == {
        "chat_template_stage": False,
        "detokenize_stage": False,
        "prepare_multimodal_stage": True,
        "tokenize_stage": True,
    }
    assert map_guide_flags({"chat_template": "{{ x }}"}) == {"chat_template_stage": {"chat_template": "{{ x }}"}}


def test_guide_flags_conflicts_are_errors():
    with pytest.raises(SpecError, match="not both"):
        map_guide_flags({"apply_chat_template": True, "chat_template_stage": False})
    with pytest.raises(SpecError, match="disabled"):
        map_guide_flags({"chat_template": "x", "apply_chat_template": False})
    with pytest.raises(SpecError, match="True or False"):
        map_guide_flags({"has_image": "yes"})


def test_messages_column_needs_generate():
    with pytest.raises(SpecError, match="messages_column needs task_type 'generate'"):
        parse_spec(body(prompt={"messages_column": "m"}, processor__task_type="embed"))


def test_spec_version_is_checked():
    with pytest.raises(SpecError, match="version"):
        parse_spec({**body(), "version": 2})


def test_job_spec_is_the_pydantic_model():
    assert isinstance(parse_spec(body()), JobSpec)


def test_lora_settings_are_checked_together():
    with pytest.raises(SpecError, match="enable_lora=True"):
        parse_spec(body(prompt__lora_column="adapter"))
    with pytest.raises(SpecError, match="needs dynamic_lora_loading_path"):
        parse_spec(body(prompt__lora_column="adapter", processor__engine_kwargs={"enable_lora": True}))
    with pytest.raises(SpecError, match="plain folder name"):
        parse_spec(body(processor__lora_adapters=["../x"]))
    spec = parse_spec(
        body(
            prompt__lora_column="adapter",
            processor__engine_kwargs={"enable_lora": True},
            processor__dynamic_lora_loading_path="/adapters",
            processor__lora_adapters=["pirate"],
        )
    )
    assert spec.prompt.required_columns() == ["adapter", "prompt"]
