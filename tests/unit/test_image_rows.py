"""Prompt rows with images (rlmega/data/images.py, rlmega/data/prompts.py): every source form, the checks made at
load, and the tokens a vision-language model's processor gives them (one placeholder per image for the engine,
expanded for the trainer)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from rlmega.data.images import BadImage, ImageLimits, split_images
from rlmega.data.prompts import BadRowError, PromptDataset, load_rows
from rlmega.data.shapes import COLOURS, draw, shape_rows


@pytest.fixture(scope="module")
def png():
    return draw(np.random.default_rng(0), 2, COLOURS["blue"])


def _message(*sources, kind="image"):
    parts = [
        {"type": kind, kind: s}
        if kind == "image"
        else {"type": "image_url", "image_url": {"url": s}}
        for s in sources
    ]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "what colour?"}]}]


def test_every_source_form_gives_the_same_bytes(tmp_path, png):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.png").write_bytes(png)
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    for messages in (
        _message("sub/a.png"),
        _message(str(tmp_path / "sub" / "a.png")),
        _message(uri),
        _message(png),
        _message({"bytes": png, "path": None}),
        _message(uri, kind="image_url"),
    ):
        out, images = split_images(messages, str(tmp_path), ImageLimits(max_pixels=10**6))
        assert images == [png]
        assert out[0]["content"] == [{"type": "image"}, {"type": "text", "text": "what colour?"}]


@pytest.mark.parametrize(
    "source, message",
    [
        ("nope.png", "message 0, part 0: image file .*nope.png cannot be read"),
        ("data:image/png;base64,@@@", "is not valid base64"),
        ("data:image/png,xyz", "is not base64"),
        (b"\x89PNG\r\n\x1a\n not an image", "image is not readable"),
        (12, "source is int, not a path, URL, data URI or bytes"),
    ],
)
def test_a_bad_image_is_named(tmp_path, source, message):
    with pytest.raises(BadImage, match=message):
        split_images(_message(source), str(tmp_path), ImageLimits(max_pixels=10**6))


def test_an_oversize_image_is_refused_before_decoding(tmp_path, png):
    with pytest.raises(
        BadImage, match=r"112x112 = 12544 pixels is over data.max_image_pixels=10000"
    ):
        split_images(_message(png), str(tmp_path), ImageLimits(max_pixels=10_000))


def test_jsonl_and_parquet_rows_carry_their_images(tmp_path, png):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.png").write_bytes(png)
    (tmp_path / "rows.jsonl").write_text(
        json.dumps({"prompt": _message("a.png"), "label": "2"})
        + "\n"
        + json.dumps({"prompt": "1+1=", "label": "2"})
        + "\n"
    )
    rows, _ = load_rows(str(tmp_path / "rows.jsonl"))
    assert rows[0]["images"] == [png] and "images" not in rows[1]
    pq.write_table(
        pa.Table.from_pylist([{"prompt": _message(png), "label": "2"}]), tmp_path / "rows.parquet"
    )
    rows, _ = load_rows(str(tmp_path / "rows.parquet"))
    assert rows[0]["images"] == [png]
    (tmp_path / "bad.jsonl").write_text(
        json.dumps({"prompt": _message("a.png"), "label": "2"})
        + "\n"
        + json.dumps({"prompt": _message("gone.png"), "label": "2"})
        + "\n"
    )
    with pytest.raises(
        BadRowError, match=r"bad.jsonl, row 2: prompt 'prompt', message 0, part 0: image file"
    ):
        load_rows(str(tmp_path / "bad.jsonl"))
    rows, skipped = load_rows(str(tmp_path / "bad.jsonl"), on_bad_row="skip")
    assert len(rows) == 1 and skipped.count == 1


def test_text_parts_without_images_become_a_plain_string(tmp_path):
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "1="}],
        }
    ]
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": messages, "label": "2"}) + "\n")
    rows, _ = load_rows(str(tmp_path / "rows.jsonl"))
    assert rows[0]["prompt"] == [{"role": "user", "content": "1+1="}] and "images" not in rows[0]


def test_the_processor_expands_what_the_engine_gets_one_placeholder_of(tmp_path):
    from transformers import AutoProcessor

    from rlmega.demo.tiny_vlm import make_tiny_vlm

    path = make_tiny_vlm(tmp_path / "vlm", arch="idefics3")
    proc = AutoProcessor.from_pretrained(path)
    rows = shape_rows(3, seed=0)
    data = PromptDataset(rows, proc.tokenizer, max_prompt_tokens=64, processor=proc, max_images=1)
    image_token = proc.tokenizer.convert_tokens_to_ids("<image>")
    for p, row in zip(data, rows):
        assert p.images == tuple(row["images"]) and p.engine_ids.count(image_token) == 1
        # one 112x112 tile, 8x8 patches shuffled by 2: 16 tokens
        assert p.token_ids.count(image_token) == 16
        assert p.request_ids() == p.engine_ids
    with pytest.raises(BadRowError, match="row 1: the prompt has 1 image.*text-only model"):
        PromptDataset(rows, proc.tokenizer, max_prompt_tokens=64)
    with pytest.raises(BadRowError, match="over rollout.max_images_per_prompt=0"):
        PromptDataset(rows, proc.tokenizer, max_prompt_tokens=64, processor=proc, max_images=0)


def test_the_colour_reward_wants_the_word():
    from rlmega.rewards.shapes import score

    responses = ("blue", "blue</s>", "blue.", "bluey", "blu", " blue", "")
    assert [score(r, "blue") for r in responses] == [1, 1, 1, 0, 0, 0, 0]


def test_shape_problems_are_reproducible_and_the_eval_set_differs():
    a, b, ev = shape_rows(20, seed=3), shape_rows(20, seed=3), shape_rows(20, seed=3, eval_set=True)
    assert [r["images"] for r in a] == [r["images"] for r in b]
    assert {r["label"] for r in a} <= {name[0] for name in COLOURS}
    assert [r["images"] for r in a] != [r["images"] for r in ev]


# --- hostile sources (issue 57): bounded reads, regular files, URLs by rule, Pillow's formats ------------------


def test_image_limits_defaults_are_the_configs():
    from rlmega.config.schema import DataConfig
    from rlmega.data.images import DEFAULT_IMAGE_LIMITS

    d = DataConfig()
    assert DEFAULT_IMAGE_LIMITS == ImageLimits(d.max_image_pixels, d.max_image_bytes, d.image_urls)


def test_a_device_a_fifo_and_a_folder_are_refused_without_reading_them(tmp_path):
    import os
    import time

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    for source in ("/dev/zero", str(tmp_path / "fifo"), "folder"):
        t0 = time.monotonic()
        with pytest.raises(BadImage, match="is not a regular file"):
            split_images(_message(source), str(tmp_path), ImageLimits())
        # /dev/zero read whole took all memory; a FIFO's open blocked forever
        assert time.monotonic() - t0 < 5


def test_no_source_yields_more_than_max_image_bytes(tmp_path, png):
    small = ImageLimits(max_bytes=len(png) - 1)
    (tmp_path / "a.png").write_bytes(png + b"\0" * 10)
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    for source in ("a.png", uri, png):
        with pytest.raises(BadImage, match=rf"over data.max_image_bytes={len(png) - 1} bytes"):
            split_images(_message(source), str(tmp_path), small)
    assert split_images(_message(png), str(tmp_path), ImageLimits(max_bytes=len(png)))[1] == [png]


def test_pillow_opens_only_the_image_formats_processors_take(tmp_path):
    # Pillow would start Ghostscript
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    with pytest.raises(BadImage, match="not readable as PNG, JPEG, WEBP, GIF, BMP"):
        split_images(_message(eps), str(tmp_path), ImageLimits())
    from PIL import Image

    with Image.open(__import__("io").BytesIO(eps)) as img:  # Pillow alone takes it for an image
        assert img.format == "EPS"


@pytest.fixture(scope="module")
def server(png):
    """A loopback HTTP server: /a.png?token=SECRET, /to-ftp (a redirect to ftp://), /big (2 MB), /slow (a byte
    every 0.2 s)."""
    import http.server
    import threading
    import time

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            path = self.path.split("?")[0]
            if path == "/to-ftp":
                self.send_response(302)
                self.send_header("Location", "ftp://127.0.0.1/a.png")
                self.end_headers()
                return
            body = {"/a.png": png, "/big": b"\0" * 2_000_000, "/slow": b"x" * 100}.get(path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if path == "/slow":
                for byte in body:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.2)
            else:
                self.wfile.write(body)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_urls_are_fetched_only_as_data_image_urls_allows(tmp_path, server, png):
    url = f"{server}/a.png?token=SECRET"
    with pytest.raises(BadImage, match="fetching URLs is off") as off:
        split_images(_message(url), str(tmp_path), ImageLimits())
    with pytest.raises(
        BadImage, match="resolves to 127.0.0.1, a loopback, private or reserved address"
    ) as public:
        split_images(_message(url), str(tmp_path), ImageLimits(urls="public"))
    # a URL's query string is never echoed
    assert "SECRET" not in str(off.value) + str(public.value)
    assert split_images(_message(url), str(tmp_path), ImageLimits(urls="any"))[1] == [png]
    with pytest.raises(
        BadImage, match="redirects to ftp://127.0.0.1/a.png, which is refused: its scheme is 'ftp'"
    ):
        split_images(_message(f"{server}/to-ftp"), str(tmp_path), ImageLimits(urls="any"))
    with pytest.raises(BadImage, match="its scheme is 'file'"):
        split_images(_message("file:///etc/passwd"), str(tmp_path), ImageLimits(urls="any"))


def _resolver(monkeypatch, answers: list[str]) -> list:
    """socket.getaddrinfo for the name 'images.example' answering each address of ``answers`` in turn (the last
    one from then on); every other name as before. Returns the addresses given out, in order."""
    import socket

    real, given = socket.getaddrinfo, []

    def getaddrinfo(host, port, *args, **kwargs):
        if host != "images.example":
            return real(host, port, *args, **kwargs)
        given.append(answers[min(len(given), len(answers) - 1)])
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (given[-1], port))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return given


def test_a_rebinding_name_is_refused_at_the_connection(tmp_path, server, monkeypatch):
    """DNS rebinding (issue 57): a name public when checked and loopback when fetched. Before, urllib looked the
    name up again to connect and fetched from the loopback server (run); under data.image_urls=public the
    connection now uses the one lookup it checks. Nothing here connects anywhere but loopback: the public answer
    is only ever checked."""
    port = server.rsplit(":", 1)[1]
    given = _resolver(monkeypatch, ["93.184.216.34", "127.0.0.1"])
    with pytest.raises(BadImage, match="refused when connecting: its host resolves to 127.0.0.1"):
        split_images(
            _message(f"http://images.example:{port}/a.png"),
            str(tmp_path),
            ImageLimits(urls="public"),
        )
    assert given == ["93.184.216.34", "127.0.0.1"]


def test_a_public_fetch_connects_to_the_address_it_checked(tmp_path, server, png, monkeypatch):
    """The public path's own connections (plain HTTP here; HTTPS in the next test) fetch what they should, through
    no proxy from the environment: loopback is let through as if it were public, to keep the test on this machine."""
    import rlmega.data.images as images

    monkeypatch.setattr(images, "_addresses_problem", lambda found: None)
    # a proxy would be refused: port 9 listens to nothing
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    port = server.rsplit(":", 1)[1]
    given = _resolver(monkeypatch, ["127.0.0.1"])
    assert split_images(
        _message(f"http://images.example:{port}/a.png"), str(tmp_path), ImageLimits(urls="public")
    )[1] == [png]
    # the early check's lookup (its verdict bypassed above) and the connection's
    assert given == ["127.0.0.1"] * 2


def test_a_public_https_fetch_verifies_the_name_it_asked_for(tmp_path, png, monkeypatch):
    """HTTPS on the pinned connection: the certificate is checked against the URL's host name, not the address."""
    import http.server
    import ssl
    import subprocess
    import threading

    import rlmega.data.images as images

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=images.example",
            "-addext",
            "subjectAltName=DNS:images.example",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(images, "_addresses_problem", lambda found: None)
        monkeypatch.setattr(
            ssl, "_create_default_https_context", lambda: ssl.create_default_context(cafile=cert)
        )
        _resolver(monkeypatch, ["127.0.0.1"])
        url = f"https://images.example:{httpd.server_address[1]}/a.png"
        assert split_images(_message(url), str(tmp_path), ImageLimits(urls="public"))[1] == [png]
        other = url.replace("images.example", "127.0.0.1")  # the right server under another name
        with pytest.raises(BadImage, match="could not be fetched"):
            split_images(_message(other), str(tmp_path), ImageLimits(urls="public"))
    finally:
        httpd.shutdown()


def test_a_fetch_is_bounded_in_bytes_and_in_time(tmp_path, server, monkeypatch):
    import time

    import rlmega.data.images as images

    with pytest.raises(BadImage, match="over data.max_image_bytes=1000000"):
        split_images(
            _message(f"{server}/big"), str(tmp_path), ImageLimits(max_bytes=1_000_000, urls="any")
        )
    # the server sends a byte every 0.2 s: 20 s for all
    monkeypatch.setattr(images, "URL_DEADLINE_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(BadImage, match="took over 1 s"):
        split_images(_message(f"{server}/slow"), str(tmp_path), ImageLimits(urls="any"))
    assert time.monotonic() - t0 < 1.0 + images.URL_READ_TIMEOUT_S


def test_on_bad_row_skip_skips_a_row_with_too_many_images(tmp_path, png):
    (tmp_path / "a.png").write_bytes(png)
    rows = [
        {"prompt": _message("a.png", "a.png"), "label": "2"},
        {"prompt": _message("a.png"), "label": "1"},
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept, skipped = load_rows(str(tmp_path / "rows.jsonl"), on_bad_row="skip", max_images=1)
    assert [r["label"] for r in kept] == ["1"] and skipped.count == 1
    assert (
        "row 1: the prompt has 2 images, over rollout.max_images_per_prompt=1" in skipped.reasons[0]
    )
    with pytest.raises(BadRowError, match="row 1: the prompt has 2 images"):
        load_rows(str(tmp_path / "rows.jsonl"), on_bad_row="error", max_images=1)
