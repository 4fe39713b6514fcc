"""Importable callables used by the tests as `module:function` references."""


def to_request(row):
    return {"messages": [{"role": "user", "content": row["q"].upper()}], "sampling_params": {"max_tokens": 3}}


def bad_request(row):
    return [row]


def guide_image_request(row):
    """The shape of the guide's vision_preprocess: a PIL image in a {"type": "image"} part, detokenize off."""
    import io

    from PIL import Image

    return {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": row["q"]},
                    {"type": "image", "image": Image.open(io.BytesIO(row["image"]["bytes"]))},
                ],
            }
        ],
        "sampling_params": {"max_tokens": 3, "detokenize": False},
    }


def answer_only(row):
    """A guide-style postprocess: the output row is the answer alone."""
    return {"answer": row["response"]}
