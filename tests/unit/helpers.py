"""Importable callables used by the tests as `module:function` references."""


def to_request(row):
    return {"messages": [{"role": "user", "content": row["q"].upper()}], "sampling_params": {"max_tokens": 3}}


def bad_request(row):
    return [row]
