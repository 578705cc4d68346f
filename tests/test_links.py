"""The base of ``url`` image links behind a proxy (issue 37 item 7): the configured public URL, else the
forwarded headers of a trusted proxy, else the address the request came to (``omni_ext.api.links``)."""

from __future__ import annotations

import base64

import pytest
import requests

from omni_ext.api import links

TRUSTED = links.trusted_networks("127.0.0.1, 10.0.0.0/8,::1")
REQUEST_BASE = "http://127.0.0.1:8091/"


def _base(headers: dict[str, str], peer: str | None = "127.0.0.1", public_url: str | None = None) -> str:
    return links.link_base(public_url, TRUSTED, peer, {k.lower(): v for k, v in headers.items()}, REQUEST_BASE)


def test_a_trusted_proxy_sets_the_base() -> None:
    assert _base({}) == "http://127.0.0.1:8091"
    assert _base({"X-Forwarded-Proto": "https", "X-Forwarded-Host": "gen.example.com"}) == "https://gen.example.com"
    assert _base({"X-Forwarded-Proto": "https", "X-Forwarded-Host": "gen.example.com:8443",
                  "X-Forwarded-Prefix": "/omni/"}) == "https://gen.example.com:8443/omni"
    # the client-facing hop is the first value of a chain
    assert _base({"X-Forwarded-Proto": "https, http", "X-Forwarded-Host": "a.example, b.internal"}) == "https://a.example"
    # RFC 7239 wins over the X- headers; its quotes and case
    assert _base({"Forwarded": 'for=1.2.3.4;Proto=https;host="[2001:db8::1]:443", for=10.0.0.2',
                  "X-Forwarded-Host": "other.example"}) == "https://[2001:db8::1]:443"
    assert _base({"X-Forwarded-Host": "gen.example.com"}, peer="10.1.2.3") == "http://gen.example.com"
    assert _base({"X-Forwarded-Host": "gen.example.com"}, peer="::1") == "http://gen.example.com"


def test_headers_from_anyone_else_or_malformed_are_ignored() -> None:
    spoof = {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "evil.example"}
    assert _base(spoof, peer="192.168.1.5") == _base(spoof, peer=None) == "http://127.0.0.1:8091"
    assert links.link_base(None, (), "127.0.0.1", {"x-forwarded-host": "evil.example"}, REQUEST_BASE) == \
        "http://127.0.0.1:8091"  # no proxy trusted: the default
    for host in ("evil.example/path", "a b", "x@y", "", "évil.example"):
        assert _base({"X-Forwarded-Host": host}) == "http://127.0.0.1:8091", host
    assert _base({"X-Forwarded-Host": "a.example", "X-Forwarded-Proto": "javascript"}) == "http://a.example"
    assert _base({"X-Forwarded-Host": "a.example", "X-Forwarded-Prefix": "/x?y=1"}) == "http://a.example"
    # the configured public URL wins over everything
    assert _base(spoof, public_url="https://gen.example.com/omni") == "https://gen.example.com/omni"


def test_trusted_proxies_setting_is_checked() -> None:
    assert links.trusted_networks(["127.0.0.1", "10.0.0.0/8"]) == links.trusted_networks("127.0.0.1,10.0.0.0/8")
    assert links.trusted_networks("") == links.trusted_networks(None) == ()
    with pytest.raises(ValueError, match="not an IP address"):
        links.trusted_networks("proxy.internal")


def test_url_links_follow_a_trusted_proxys_headers(server_pool) -> None:
    """The "qwen" server trusts 127.0.0.1 (OMNI_EXT_API_TRUSTED_PROXIES): a request sent as a proxy sends
    it gets links under the client-facing address; one without the headers, the address it came to."""
    server = server_pool.get("qwen")
    body = {"prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 2, "seed": 3, "response_format": "url"}
    proxied = requests.post(server.url + "/v1/images/generations", json=body, timeout=120, headers={
        "X-Forwarded-Proto": "https", "X-Forwarded-Host": "gen.example.com", "X-Forwarded-Prefix": "/omni"})
    assert proxied.status_code == 200, proxied.text[:300]
    link = proxied.json()["data"][0]["url"]
    # vLLM-Omni's own answer field: its stage durations (the pipeline's too, with its profiler on), as its route gives them
    assert proxied.json()["metrics"]["stage_durations"] and "peak_memory_mb" in proxied.json()["metrics"], proxied.json()
    assert link.startswith("https://gen.example.com/omni/v1/images/img_"), link
    direct = requests.post(server.url + "/v1/images/generations", json=body, timeout=120).json()["data"][0]["url"]
    assert direct.startswith(server.url + "/v1/images/img_"), direct
    # the proxy strips its prefix: the same path on the server gives the same image
    assert requests.get(server.url + link.removeprefix("https://gen.example.com/omni"), timeout=60).content == \
        requests.get(direct, timeout=60).content
    b64 = requests.post(server.url + "/v1/images/generations", json={**body, "response_format": "b64_json"},
                        timeout=120).json()["data"][0]["b64_json"]
    assert requests.get(direct, timeout=60).content == base64.b64decode(b64)
