"""Tenants: what one API key creates, another key cannot see or touch (:mod:`omni_ext.api.tenants`).

Pure rules first, then the real servers of the shared pool started with three keys (tenant A,
tenant B, an admin; ``conftest.TENANT_KEYS``): ``wan-api`` (videos; its admin named as
``sha256:<hex>`` in ``--additional-config``) and ``qwen-cfg2`` (image links; its admin named by the
key in ``OMNI_EXT_API_ADMIN_KEYS``), every route over HTTP with the ``openai`` SDK and raw requests.
"""

from __future__ import annotations

import hashlib
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import requests

from omni_ext.api.jobs import Job, JobStore
from omni_ext.api.settings import load_settings
from omni_ext.api.tenants import SINGLE_TENANT, Tenancy, Tenant, admin_hashes, key_hash, tenancy
from tests.conftest import TENANT_KEYS

A, B, ADMIN = TENANT_KEYS
HA, HB = key_hash(A), key_hash(B)


def h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- pure rules -----------------------------------------------------------------------------------
def test_key_hash_is_vllms_sha256_and_admins_take_keys_or_hashes() -> None:
    assert key_hash("sk-1") == hashlib.sha256(b"sk-1").hexdigest()
    assert admin_hashes(["sk-1", " sha256:" + key_hash("sk-2").upper(), ""]) == {key_hash("sk-1"), key_hash("sk-2")}
    with pytest.raises(ValueError, match="64 hex"):
        admin_hashes(["sha256:abc"])


def test_tenancy_follows_vllms_keys_and_checks_admins_at_start() -> None:
    assert tenancy(SimpleNamespace(api_key=None), [], environ={}) == Tenancy(keyed=False)
    assert tenancy(SimpleNamespace(api_key=None), [], environ={"VLLM_API_KEY": "sk-env"}).keyed  # vLLM's fallback
    rule = tenancy(SimpleNamespace(api_key=["sk-a", "sk-root"]), ["sk-root"], environ={})
    assert rule.keyed and rule.admins == {key_hash("sk-root")}
    with pytest.raises(ValueError, match="none of --api-key"):
        tenancy(SimpleNamespace(api_key=["sk-a"]), ["sk-other"], environ={})
    with pytest.raises(ValueError, match="no --api-key"):
        tenancy(SimpleNamespace(api_key=None), ["sk-a"], environ={})


def test_a_tenant_sees_its_own_an_admin_all_and_a_keyless_server_is_single_tenant() -> None:
    rule = Tenancy(keyed=True, admins=frozenset({key_hash("sk-root")}))
    a, root = rule.tenant("Bearer sk-a"), rule.tenant("bearer sk-root")
    assert a == Tenant(key_hash("sk-a"), False) and a.scope == key_hash("sk-a")
    assert a.sees(key_hash("sk-a")) and not a.sees(key_hash("sk-b")) and not a.sees(None)
    assert root.admin and root.scope is None and root.sees(None) and root.sees(key_hash("sk-a"))
    nobody = rule.tenant(None)  # vLLM's middleware stops it first; were it let in, it sees nothing
    assert not nobody.admin and nobody.scope == "" and not nobody.sees(None)
    assert Tenancy(keyed=False).tenant("Bearer anything") is SINGLE_TENANT and SINGLE_TENANT.sees(None)


def test_admin_keys_read_from_additional_config_or_env(tmp_path: Path) -> None:
    args = SimpleNamespace(additional_config={"omni_ext": {"api": {"admin_keys": ["sk-root"]}}}, port=1)
    assert load_settings(args, environ={}).admin_keys == ("sk-root",)
    assert load_settings(args, environ={"OMNI_EXT_API_ADMIN_KEYS": "a, b"}).admin_keys == ("a", "b")
    with pytest.raises(ValueError, match="admin_keys"):
        load_settings(SimpleNamespace(additional_config={"omni_ext": {"api": {"admin_keys": "sk-root"}}}), environ={})


def test_store_keeps_the_owner_and_lists_one_owners_jobs(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite")
    for i, owner in enumerate([HA, HB, HA, None]):
        store.add(Job(id=f"video_{i}", kind="video", owner=owner))
    assert store.get("video_1").owner == HB
    assert [j.id for j in store.list("video", after=None, limit=10, order="asc", owner=HA)[0]] == ["video_0", "video_2"]
    assert len(store.list("video", after=None, limit=10, order="asc")[0]) == 4  # an admin's list
    assert store.list("video", after=None, limit=10, order="asc", owner="")[0] == []
    assert [j.id for j in store.list("video", after="video_0", limit=10, order="asc", owner=HA)[0]] == ["video_2"]
    with pytest.raises(KeyError):  # another owner's id pages like an unknown one
        store.list("video", after="video_1", limit=10, order="asc", owner=HA)


def test_a_store_written_before_owners_opens_with_its_jobs_the_admins(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "jobs.sqlite")
    db.executescript("CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, kind TEXT "
                     "NOT NULL, status TEXT NOT NULL, progress INTEGER NOT NULL DEFAULT 0, model TEXT, prompt TEXT, "
                     "seconds TEXT, size TEXT, created_at INTEGER NOT NULL, completed_at INTEGER, expires_at INTEGER, "
                     "error_code TEXT, error_message TEXT, media TEXT, meta TEXT NOT NULL DEFAULT '{}');"
                     "INSERT INTO jobs (id, kind, status, created_at) VALUES ('video_old', 'video', 'completed', 1);")
    db.commit()
    db.close()
    store = JobStore(tmp_path / "jobs.sqlite")
    assert store.get("video_old").owner is None
    assert store.list("video", after=None, limit=5, order="asc", owner=HA)[0] == []


# ---- real servers ---------------------------------------------------------------------------------
SMALL = {"prompt": "a paper boat on a pond", "size": "32x32", "num_frames": "5", "num_inference_steps": "2",
         "seed": "3"}


def _create(server, key: str) -> dict:
    resp = requests.post(server.url + "/v1/videos", files={k: (None, v) for k, v in SMALL.items()}, headers=h(key),
                         timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _wait(server, key: str, video_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = requests.get(f"{server.url}/v1/videos/{video_id}", headers=h(key), timeout=30).json()
        if body["status"] in ("completed", "failed"):
            return body
        time.sleep(0.1)
    raise AssertionError(f"{video_id} not done")


def _not_found(resp: requests.Response) -> None:
    assert resp.status_code == 404, (resp.status_code, resp.text[:300])
    assert resp.json()["error"]["code"].endswith("_not_found")


def _ids(server, key: str) -> set[str]:
    ids, after = set(), None
    while True:
        body = requests.get(server.url + "/v1/videos", params={"limit": 100, **({"after": after} if after else {})},
                            headers=h(key), timeout=30).json()
        ids |= {v["id"] for v in body["data"]}
        if not body["has_more"]:
            return ids
        after = body["last_id"]


def _placement_ids(server, key: str) -> set[str]:
    body = requests.get(server.url + "/v1/omni_ext/placements", params={"after": "0", "limit": 1000}, headers=h(key),
                        timeout=30)
    assert body.status_code == 200, body.text
    return {e["request_id"] for e in body.json()["data"]}


def test_videos_belong_to_the_key_that_made_them(server_pool) -> None:
    server = server_pool.get("wan-api")
    mine = _create(server, A)
    assert _wait(server, A, mine["id"])["status"] == "completed"
    other = _create(server, B)
    assert _wait(server, B, other["id"])["status"] == "completed"
    sync = requests.post(server.url + "/v1/videos/sync", files={k: (None, v) for k, v in SMALL.items()}, headers=h(B),
                         timeout=300)
    assert sync.status_code == 200, sync.text
    sync_id = sync.headers["X-Request-Id"]

    # B: A's video answers exactly like an id that does not exist, on every route
    vid = mine["id"]
    for method, path in (("get", f"/v1/videos/{vid}"), ("get", f"/v1/videos/{vid}/content"),
                         ("get", f"/v1/videos/{vid}/content?variant=thumbnail"),
                         ("get", f"/v1/videos/{vid}/content?variant=spritesheet"),
                         ("post", f"/v1/videos/{vid}/remix"), ("delete", f"/v1/videos/{vid}")):
        body = {"json": {"prompt": "x"}} if method == "post" else {}
        theirs = getattr(requests, method)(server.url + path, headers=h(B), timeout=30, **body)
        unknown = getattr(requests, method)(server.url + path.replace(vid, "video_" + "0" * 32), headers=h(B),
                                            timeout=30, **body)
        assert theirs.status_code == unknown.status_code == 404, (path, theirs.text[:200])
        assert theirs.json()["error"]["code"] == unknown.json()["error"]["code"]
    paged = requests.get(server.url + "/v1/videos", params={"after": vid}, headers=h(B), timeout=30)
    assert paged.status_code == 400 and paged.json()["error"]["param"] == "after"
    # lists: each tenant its own; the admin all
    a_ids, b_ids, all_ids = _ids(server, A), _ids(server, B), _ids(server, ADMIN)
    assert vid in a_ids and other["id"] not in a_ids
    assert other["id"] in b_ids and vid not in b_ids
    assert {vid, other["id"]} <= all_ids and not (a_ids & b_ids)
    # placements: the journal shows each key only its own requests (the engine's id carries a suffix)
    a_rids, b_rids, all_rids = _placement_ids(server, A), _placement_ids(server, B), _placement_ids(server, ADMIN)
    assert any(r.startswith(vid) for r in a_rids) and not any(r.startswith(vid) for r in b_rids)
    assert any(r.startswith(sync_id) for r in b_rids) and not any(r.startswith(sync_id) for r in a_rids)
    assert any(r.startswith(vid) for r in all_rids) and any(r.startswith(sync_id) for r in all_rids)
    # info says what the key sees
    access = {k: requests.get(server.url + "/v1/omni_ext/info", headers=h(k), timeout=30).json()["access"]
              for k in (A, ADMIN)}
    assert access == {A: {"api_keys": True, "sees": "own"}, ADMIN: {"api_keys": True, "sees": "all"}}
    # the owner (the SDK) reads and downloads its video; the admin manages anybody's
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=A, max_retries=0)
    assert client.videos.retrieve(vid).status == "completed"
    assert client.videos.download_content(vid).read()[4:8] == b"ftyp"
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.url + "/v1", api_key=B, max_retries=0).videos.retrieve(vid)
    assert requests.get(f"{server.url}/v1/videos/{other['id']}/content", headers=h(ADMIN), timeout=30).status_code == 200
    assert requests.delete(f"{server.url}/v1/videos/{other['id']}", headers=h(ADMIN), timeout=30).json()["deleted"]
    assert requests.get(f"{server.url}/v1/videos/{other['id']}", headers=h(B), timeout=30).status_code == 404
    assert client.videos.delete(vid).deleted
    # the store holds the key's hash, never the key
    db = Path(server.env["OMNI_EXT_API_DATA_DIR"]) / "jobs.sqlite"
    raw = b"".join(p.read_bytes() for p in db.parent.glob("jobs.sqlite*"))
    assert not any(k.encode() in raw for k in TENANT_KEYS)
    owners = {r[0] for r in sqlite3.connect(db).execute("SELECT owner FROM jobs WHERE owner IS NOT NULL")}
    assert owners <= {HA, HB, key_hash(ADMIN)}


def test_image_links_work_for_their_owner_only_unless_signed(server_pool) -> None:
    """A plain image link needs its owner's (or an admin's) key; the signed link the server returns
    (``omni_ext.api.signed_url_ttl_s`` 600 on this server) loads with no key at all, as in an ``<img>``
    tag, and opens nothing but that image: a changed signature or another image's path is refused."""
    server = server_pool.get("qwen-cfg2")
    body = {"prompt": "a lighthouse", "size": "32x32", "num_inference_steps": 2, "seed": 5, "response_format": "url"}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=A, max_retries=0)
    model = requests.get(server.url + "/v1/models", headers=h(A), timeout=30).json()["data"][0]["id"]
    resp = client.images.generate(model=model, **{k: v for k, v in body.items() if k in ("prompt", "size", "response_format")},
                                  extra_body={"num_inference_steps": 2, "seed": 5})
    link = resp.data[0].url
    url, _, query = link.partition("?")
    params = dict(p.split("=", 1) for p in query.split("&"))
    assert set(params) == {"expires", "signature"}, link
    assert 590 <= int(params["expires"]) - time.time() <= 601
    assert requests.get(url, headers=h(A), timeout=30).content[:4] == b"\x89PNG"
    _not_found(requests.get(url, headers=h(B), timeout=30))
    assert requests.get(url, headers=h(ADMIN), timeout=30).status_code == 200
    assert requests.get(url, timeout=30).status_code == 401  # vLLM's key check still comes first
    keyless = requests.get(link, timeout=30)  # what an <img src> does
    assert keyless.status_code == 200 and keyless.content[:4] == b"\x89PNG", keyless.text[:300]
    assert keyless.content == requests.get(url, headers=h(A), timeout=30).content
    forged = link[:-4] + ("0000" if not link.endswith("0000") else "1111")
    refused = requests.get(forged, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    other = client.images.generate(model=model, prompt="a harbour", size="32x32", response_format="url",
                                   extra_body={"num_inference_steps": 2, "seed": 6}).data[0].url.partition("?")[0]
    assert requests.get(f"{other}?{query}", timeout=30).status_code == 401  # the signature names one image
    assert requests.get(f"{server.url}/v1/videos?{query}", timeout=30).status_code == 401  # and no other path
