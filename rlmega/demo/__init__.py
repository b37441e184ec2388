"""The demo's model makers: tiny, randomly initialised Hugging Face model folders made on the spot (no hub).

tiny_model.py    a text model of any family of the table (rlmega/config/families.py), with its tokenizer
tiny_vlm.py      a vision-language model (Idefics3 or Qwen2-VL shape), with its processor
"""
