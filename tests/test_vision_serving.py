"""Images over SGLang's /generate (sglang 0.5.23's image_data): our server (rollouts/server/,
in this process, on a tiny Qwen2.5-VL checkpoint loaded as the server loads one) against the
embedded engine through the SGLang client (rollouts/sglang.py), the request forms SGLang
reads, and its answers to what it refuses (rollouts/image_data.py cites the lines)."""

import base64
import dataclasses
import io
import string
import threading
import time

import httpx
import jax
import numpy as np
import pytest
from PIL import Image

from models import hf, transformer, vision
from models.config import tiny, tiny_vision
from models.tokenizer import DEFAULT_ALPHABET, CharTokenizer
from rollouts import image_data
from rollouts.server import protocol
from rollouts.engine import SamplingParams
from rollouts.jax_engine import JaxEngine
from rollouts.server.main import load_model
from rollouts.server.protocol import expand_request
from rollouts.sglang import SGLangClient, ServerError, request_body
from rollouts.sglang_engine import SGLangEngine
from tests.helpers import serving
from tests.test_sglang import api_types  # noqa: F401 (SGLang's JSON contract, a fixture)

pytestmark = pytest.mark.xdist_group("vision_serving")

SPECIALS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
CHARS = CharTokenizer(DEFAULT_ALPHABET + string.ascii_uppercase + "\n'", SPECIALS)
START, IMAGE, END, VIDEO = (CHARS.encode(s)[0] for s in SPECIALS)
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)
BODY = {"sampling_params": {"max_new_tokens": 3, "temperature": 0.0}, "return_logprob": True,
        "return_prompt_token_ids": True}


def picture(height: int, width: int, seed: int, fmt: str = "PNG", mode: str = "RGB") -> bytes:
  """A random smooth image, encoded."""
  rng = np.random.default_rng(seed)
  small = rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
  image = Image.fromarray(small).resize((width, height), Image.Resampling.BILINEAR)
  buffer = io.BytesIO()
  image.convert(mode).save(buffer, format=fmt)
  return buffer.getvalue()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  """(cfg, params, checkpoint path) of a tiny random Qwen2.5-VL, written as a Hugging Face
  checkpoint and loaded back as the server loads one."""
  tower = tiny_vision(32, (IMAGE, START, END, VIDEO), hidden_size=32)
  cfg = tiny(CHARS.vocab_size, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             intermediate_size=64, vision=tower)
  path = hf.save(transformer.init_params(cfg, jax.random.PRNGKey(0)), cfg,
                 str(tmp_path_factory.mktemp("qwen2_5_vl") / "v0"))
  loaded, params, served = load_model(hf_checkpoint=path, dtype="float32")
  assert loaded == cfg and loaded.family == "qwen2_5_vl" and served == path
  return cfg, params, path


@pytest.fixture(scope="module")
def server(model):
  cfg, params, path = model
  with serving(cfg, params, model_path=path) as (url, scheduler):
    yield url, scheduler


@pytest.fixture
def http():
  with httpx.Client(timeout=120) as client:
    yield client


def prompt(cfg, images, texts, expanded: bool = True) -> list[int]:
  """texts[0], image 0 (vision start, its image tokens, vision end), texts[1], ...: one image
  token per merged patch (the trainer's prompt), or one per image."""
  ids = list(CHARS.encode(texts[0]))
  for text in texts[1:]:
    ids += [START, IMAGE, END] + list(CHARS.encode(text))
  if not expanded:
    return ids
  return vision.expand_image_tokens(ids, [vision.image_grid(im, cfg.vision) for im in images],
                                    cfg.vision)


def b64(data: bytes) -> str:
  return base64.b64encode(data).decode("ascii")


def outputs(reply: dict) -> tuple[list[int], list[float]]:
  meta = reply["meta_info"]
  return reply["output_ids"], [e[0] for e in meta["output_token_logprobs"]]


def test_images_through_the_server_equal_the_embedded_engine(model, server, tmp_path):
  """One-image, two-image and text-only prompts in one batch, the images given as JPEG bytes,
  a path and an RGBA PIL image (the client sends each as PNG of its RGB pixels): greedy
  tokens and log-probs equal the embedded engine's, and so do continuations (prompt + the
  tokens so far, as partial rollouts resume)."""
  cfg, params, _ = model
  url, _ = server
  png = tmp_path / "two.png"
  png.write_bytes(picture(90, 60, 2))
  rgba = Image.open(io.BytesIO(picture(56, 56, 3, mode="RGBA")))
  images = [[picture(60, 90, 1, fmt="JPEG")], [str(png), rgba], []]
  prompts = [prompt(cfg, images[0], ["a ", " what"]), prompt(cfg, images[1], ["b", "c", "d?"]),
             list(CHARS.encode("just text"))]
  local = JaxEngine(cfg, params)
  engine = SGLangEngine(SGLangClient([url]), cfg, weights_dir="unused")
  try:
    want = local.generate(prompts, GREEDY, seed=0, images=images)
    got = engine.generate(prompts, GREEDY, seed=0, images=images)
    for g, w in zip(got, want):
      assert g.token_ids.tolist() == w.token_ids.tolist() and g.finish_reason == w.finish_reason
      np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5, rtol=0)
      assert IMAGE not in w.token_ids  # else a continuation would hold an image token more
    half = SamplingParams(max_new_tokens=2, temperature=0.0)
    resumed = [p + w.token_ids[:2].tolist() for p, w in zip(prompts, want)]
    local_rest = local.generate(resumed, half, seed=0, images=images)
    rest = engine.generate(resumed, half, seed=0, images=images)
    for r, lr, w in zip(rest, local_rest, want):
      assert r.token_ids.tolist() == lr.token_ids.tolist() == w.token_ids[2:].tolist()
      np.testing.assert_allclose(r.logprobs, w.logprobs[2:], atol=1e-5, rtol=0)
      np.testing.assert_allclose(lr.logprobs, w.logprobs[2:], atol=1e-5, rtol=0)
  finally:
    engine.client.close()


def test_request_forms_give_the_same_result(model, server, http, tmp_path):
  """A data URL, bare base64, an absolute path and a file:// URL; one item, a list per batch
  element, a list of lists, a lone item for a whole batch, n > 1: the same tokens, and
  prompt_token_ids with each image token expanded to its image's merged patches."""
  cfg, _, _ = model
  url, _ = server
  first, second = picture(60, 90, 1), picture(84, 56, 4)
  path = tmp_path / "first.png"
  path.write_bytes(first)
  ids = prompt(cfg, [first], ["a ", " what"], expanded=False)
  expanded = prompt(cfg, [first], ["a ", " what"])
  call = lambda **body: http.post(url + "/generate", json={**BODY, **body}).json()
  reference = call(input_ids=ids, image_data=image_data.data_url(first))
  assert reference["prompt_token_ids"] == expanded
  assert reference["meta_info"]["prompt_tokens"] == len(expanded)
  for form in (b64(first), str(path), f"file://{path}", [b64(first)]):
    assert outputs(call(input_ids=ids, image_data=form)) == outputs(reference), form
  other = call(input_ids=ids, image_data=image_data.data_url(second))
  assert outputs(other) != outputs(reference)  # the image matters
  batches = (call(input_ids=[ids, ids], image_data=[b64(first), b64(second)]),
             call(input_ids=[ids, ids], image_data=[[b64(first)], [b64(second)]]))
  for batch in batches:
    assert [outputs(r) for r in batch] == [outputs(reference), outputs(other)]
  lone = call(input_ids=[ids, ids], image_data=b64(second))  # every prompt's image
  assert [outputs(r) for r in lone] == [outputs(other)] * 2
  samples = call(input_ids=ids, image_data=b64(first),
                 sampling_params={**BODY["sampling_params"], "n": 2})
  assert [outputs(r) for r in samples] == [outputs(reference)] * 2
  # a list with no image for a prompt: that prompt is text
  text = list(CHARS.encode("just text"))
  mixed = call(input_ids=[ids, text], image_data=[[b64(first)], None])
  assert outputs(mixed[0]) == outputs(reference)
  assert mixed[1]["prompt_token_ids"] == text


def test_refusals_are_sglangs(model, server, http):
  """What SGLang refuses, with its status and error shape: more placeholders than images,
  a prompt already expanded, images it cannot read or decode, a batch's image_data of
  another length, shapes outside its contract; more images than placeholders run on the
  first ones (SGLang warns and drops the rest)."""
  cfg, _, _ = model
  url, _ = server
  first = picture(60, 90, 1)
  one = prompt(cfg, [first], ["a ", " what"], expanded=False)
  two = prompt(cfg, [first, first], ["a", "b", "c"], expanded=False)
  post = lambda **body: http.post(url + "/generate", json={**BODY, **body})

  def refused(status, message, **body):
    reply = post(**body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    text = error if status == 400 and isinstance(error, str) else error["message"]
    assert message in text, text

  refused(400, "Prompt has 2 image placeholders but 1 image inputs were provided",
          input_ids=two, image_data=b64(first))
  refused(400, "The total number of <|image_pad|> tokens in the prompts should be the same as "
          "the number of images passed. Found total 6 <|image_pad|> tokens and 1 images.",
          input_ids=prompt(cfg, [first], ["a ", " what"]), image_data=b64(first))
  refused(400, "An exception occurred while loading IMAGE data at index 0: Error while loading "
          "data bm90IGFuIGltYWdl: Could not decode image",
          input_ids=one, image_data=b64(b"not an image"))
  refused(400, "fetches no URLs", input_ids=one, image_data="https://example.com/cat.png")
  refused(400, "Error while loading data cat.png", input_ids=one,
          image_data="cat.png")  # a relative path is read as base64
  refused(400, "Invalid image: {'url'", input_ids=one,
          image_data={"url": b64(first)})  # in the contract; load_image takes no dict
  refused(400, "The length of image_data should be equal to the batch size.",
          input_ids=[one, one], image_data=[b64(first)] * 3)
  refused(400, "unknown field `size` in MediaRef", input_ids=one,
          image_data={"url": b64(first), "size": 3})
  refused(400, "invalid type for an image_data item: int", input_ids=one, image_data=[3])
  missing = post(input_ids=one, image_data="/nonexistent/cat.png")  # not a client's error
  assert (missing.status_code, missing.text) == (500, "Internal Server Error")
  extra = post(input_ids=one, image_data=[b64(first), b64(picture(84, 56, 4))]).json()
  alone = post(input_ids=one, image_data=b64(first)).json()
  assert outputs(extra) == outputs(alone)
  assert extra["prompt_token_ids"] == alone["prompt_token_ids"]


def test_requests_and_responses_validate_against_sglangs_contract(api_types, model, server,
                                                                  http):
  """The client's request with images and the server's answer fit SGLang's JSON contract
  (sglang/api/v1/api_types.py), and the server's gate takes exactly the image_data shapes
  the contract takes."""
  cfg, _, _ = model
  url, _ = server
  first = picture(60, 90, 1)
  engine = SGLangEngine(SGLangClient([url]), cfg, weights_dir="unused")
  try:
    request, = engine.requests([prompt(cfg, [first], ["a ", " what"])], 3, 0, images=[[first]])
  finally:
    engine.client.close()
  body = request_body(request, GREEDY)
  api_types.GenerateRequest.from_json_value(body)
  assert body["input_ids"] == prompt(cfg, [first], ["a ", " what"], expanded=False)
  assert body["image_data"][0].startswith("data:image/png;base64,")
  reply = http.post(url + "/generate", json=body).json()
  api_types.GenerateResponse.from_json_value(reply)
  assert reply["prompt_token_ids"] == list(request.images.expanded)
  item = b64(first)
  for shape in (item, [item], [[item]], [None, item], [[item], None], {"url": item},
                [3], [[3]], {"url": item, "size": 3}, {"url": 3}, [[item], item], 3):
    try:
      api_types.GenerateRequest.from_json_value({"input_ids": [1], "image_data": shape})
      accepted = True
    except api_types.JsonContractError:
      accepted = False
    try:
      image_data.per_prompt(shape, 2, True)
      ours = True
    except image_data.ContractError:
      ours = False
    except ValueError:  # past the contract: a batch of 2 takes lists of 2
      ours = True
    assert ours == accepted, shape


def test_client_refusals_and_the_expansion_check(model, server):
  """The client refuses images for a text-only model and prompts whose runs of image tokens
  do not match their images, before sending; and a server that expands an image to another
  count than the trainer did (other pixel bounds) is an error naming both counts."""
  cfg, _, _ = model
  url, _ = server
  big = picture(200, 200, 5)
  engine = SGLangEngine(SGLangClient([url]), cfg, weights_dir="unused")
  # The trainer resizes to at most 112 x 112 pixels, the server to 224 x 224.
  small = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision,
                                                              max_pixels=112 * 112))
  shrunk = SGLangEngine(engine.client, small, weights_dir="unused")
  text_only = SGLangEngine(engine.client, tiny(CHARS.vocab_size), weights_dir="unused")
  try:
    ids = prompt(cfg, [big], ["a ", " what"])
    with pytest.raises(ValueError, match="prompt 0 holds 1 runs of image tokens .* for its 2"):
      engine.generate([ids], GREEDY, seed=0, images=[[big, big]])
    with pytest.raises(ValueError, match="images given to a qwen2 model, which has no vision"):
      text_only.generate([ids], GREEDY, seed=0, images=[[big]])
    with pytest.raises(ServerError, match=r"expanded the images of .* to \[49\] image tokens, "
                       r"the trainer to \[16\]"):
      shrunk.generate([prompt(small, [big], ["a ", " what"])], GREEDY, seed=0, images=[[big]])
  finally:
    engine.client.close()


def test_a_text_only_model_ignores_image_data(http):
  """SGLang runs no multimodal processor for a model without a vision tower and ignores
  image_data (tokenizer_manager.py _tokenize_one_request): the same tokens as without."""
  cfg = tiny(CHARS.vocab_size, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             intermediate_size=64)
  ids = [START, IMAGE, END] + list(CHARS.encode("what"))
  with serving(cfg, transformer.init_params(cfg, jax.random.PRNGKey(1))) as (url, _):
    post = lambda **body: http.post(url + "/generate", json={**BODY, "input_ids": ids, **body})
    without = post().json()
    given = post(image_data=b64(picture(60, 90, 1))).json()
  assert outputs(given) == outputs(without) and given["prompt_token_ids"] == ids


def test_the_prefix_cache_tells_images_apart(model, server, http):
  """An aborted request's keys and values are kept under its tokens and its images'
  digests: resumed with the same image it is a cache hit, with another image (the same ids)
  a miss."""
  cfg, _, _ = model
  url, scheduler = server
  first, second = picture(60, 90, 1), picture(60, 90, 6)
  ids = prompt(cfg, [first], ["a ", " what"], expanded=False)
  body = {"input_ids": ids, "image_data": b64(first), "rid": "cache-1",
          "sampling_params": {"max_new_tokens": 400, "temperature": 0.0}}
  (r,), _ = expand_request(body, vision_cfg=cfg.vision)
  scheduler.submit([r])
  with scheduler.lock:
    assert scheduler.lock.wait_for(lambda: len(r.tokens) >= 3, 120)
    scheduler.abort("cache-1")
  assert r.done.wait(60) and r.finish_reason["type"] == "abort"
  deadline = time.monotonic() + 60
  while scheduler.running and time.monotonic() < deadline:  # stored as the batch ends
    time.sleep(0.01)
  assert IMAGE not in r.tokens
  assert tuple(r.input_ids + r.tokens) + r.image_key in scheduler.prefixes
  assert len(r.image_key) == 1
  resumed = ids + r.tokens
  call = lambda **body: http.post(url + "/generate", json={**BODY, **body}).json()
  hit = call(input_ids=resumed, image_data=b64(first))
  miss = call(input_ids=resumed, image_data=b64(second))
  assert hit["meta_info"]["cached_tokens"] == len(r.input_ids) + len(r.tokens)
  assert miss["meta_info"]["cached_tokens"] == 0
  # Together: the miss is prefilled (with its image) beside the hit's cached rows.
  both = call(input_ids=[resumed, resumed], image_data=[b64(first), b64(second)])
  assert [m["meta_info"]["cached_tokens"] for m in both] == [len(hit["prompt_token_ids"]), 0]
  for alone, together in zip((hit, miss), both):
    assert alone["output_ids"] == together["output_ids"]
    np.testing.assert_allclose(outputs(together)[1], outputs(alone)[1], atol=1e-5, rtol=0)


def test_an_abort_while_images_load_is_lost_as_in_sglang_and_a_stop_holds_anyway(
    model, server, monkeypatch):
  """SGLang registers a rid before it loads and processes the request's images, and passes on
  only the first abort of a rid it knows: one that comes meanwhile reaches a scheduler that
  does not have the request yet, and the request runs its whole allowance
  (tokenizer_manager.py L926, L1202-1217, L2246-2251). Our server does the same (images made
  slow to load here). The client's stop holds anyway: a rid still running abort_grace s
  after its first abort has its worker aborted whole, again until it returns."""
  cfg, _, _ = model
  url, _ = server
  loads = protocol.expand_images
  monkeypatch.setattr(protocol, "expand_images",
                      lambda *args: (time.sleep(1.5), loads(*args))[1])
  pic = picture(64, 64, 3)
  ids = prompt(cfg, [pic], ["a ", " what"])
  allowance = 1500
  body = {"rid": "loading", "input_ids": image_data.collapse(ids, IMAGE),
          "image_data": [f"data:image/png;base64,{b64(pic)}"],
          "sampling_params": {"max_new_tokens": allowance, "temperature": 0.0,
                              "ignore_eos": True}}
  with httpx.Client(timeout=300) as http:
    sent = time.monotonic()
    thread = threading.Thread(target=lambda: box.append(http.post(url + "/generate",
                                                                  json=body)))
    box = []
    thread.start()
    time.sleep(0.5)  # the images are loading: the rid is known, the request is not queued
    assert http.post(url + "/abort_request", json={"rid": "loading"}).status_code == 200
    time.sleep(1.5)  # now it runs; a second abort of the rid is dropped too
    assert http.post(url + "/abort_request", json={"rid": "loading"}).status_code == 200
    thread.join(300)
    ran = time.monotonic() - sent
  reply = box[0].json()
  assert reply["meta_info"]["finish_reason"]["type"] == "length"
  assert len(reply["output_ids"]) == allowance

  client = SGLangClient([url], abort_grace=0.3)
  engine = SGLangEngine(client, cfg, weights_dir="unused")
  try:
    started = time.monotonic()
    made = engine.generate([list(CHARS.encode("hi")), ids],
                           SamplingParams(max_new_tokens=allowance, temperature=0.0,
                                          stop_token_ids=()),
                           seed=0, max_new_tokens=[1, allowance], images=[[], [pic]],
                           stop_when=lambda index, completion: index == 0)
    took = time.monotonic() - started
  finally:
    client.close()
  assert made[0].finish_reason == "length" and len(made[0].token_ids) == 1
  assert made[1].finish_reason == "abort", made[1].finish_reason
  assert len(made[1].token_ids) < allowance / 2, (len(made[1].token_ids), ran)
  assert took < ran, (took, ran)
