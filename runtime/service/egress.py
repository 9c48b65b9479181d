"""Where the server itself may connect: the policy of every fetch a request causes.

Two things make the server fetch a URL a client names: an image or audio URL in a request
(``mediafetch``, with ``--mmproj``) and the CORS proxy (``/cors-proxy``, ``--ui-mcp-proxy``).
Without a policy each is a way into what the operator never exposed: the machine's own
services on loopback, the cloud's metadata service at 169.254.169.254, the private network
behind the server. So, on every hop (the first request and each redirect):

- the URL's host must be one of the allowed host names, when a list is given (vLLM's
  ``--allowed-media-domains``; a redirect to another host is refused like a first URL);
- the host is resolved here, every address it resolves to is checked, and the connection
  goes to one of those checked addresses (the Host header and TLS's SNI and certificate check
  keep the name): a name cannot resolve to a public address for the check and to a private one
  for the connection (DNS rebinding), because it is resolved once;
- refused by default: loopback, private (10/8, 172.16/12, 192.168/16, fc00::/7), shared
  (CGNAT, 100.64/10), link-local (169.254/16, fe80::/10), multicast, unspecified and every
  other address that is not globally reachable, and the same addresses written inside IPv6
  (IPv4-mapped ``::ffff:a.b.c.d``, IPv4-compatible, 6to4, Teredo, NAT64). A name that resolves
  to any such address is refused whole. ``allow_private`` (an operator's explicit opt-in)
  lets loopback, private and shared addresses through; link-local, multicast, unspecified and
  reserved addresses stay refused (no server has a reason to fetch from them);
- at most ``MAX_REDIRECTS`` redirects, each checked as above.

A refusal is an ``EgressRefused`` whose message is for the server's log: what a client is told
is one text for every failure (its caller's), so that the answers cannot map which addresses
and ports answer (a port scanner).
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import anyio
import httpx

MAX_REDIRECTS = 3
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
DEFAULT_PORTS = {"http": 80, "https": 443}

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# allowed with allow_private: the networks an operator may run their own services on
_PRIVATE_NETS = tuple(
    ipaddress.ip_network(net) for net in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7")
)
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


class EgressRefused(Exception):
    """A URL the policy does not allow, or one that could not be resolved (the message is for the log)."""


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for, where it stands for one."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]  # the client's address
    if any(ip in net for net in _NAT64):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if int(ip) >> 32 == 0 and int(ip) > 1:  # IPv4-compatible ::a.b.c.d (deprecated; not :: or ::1)
        return ipaddress.IPv4Address(int(ip))
    return None


def refused_because(ip: IPAddress, allow_private: bool = False) -> str | None:
    """Why the policy refuses a connection to ``ip``, or None when it allows one."""
    if isinstance(ip, ipaddress.IPv6Address):
        v4 = _embedded_v4(ip)
        if v4 is not None:
            why = refused_because(v4, allow_private)
            if ip.ipv4_mapped is not None or why is not None:  # a mapped address is that IPv4 host
                return f"{why} (written as IPv6)" if why else None
    if ip.is_multicast:
        return "a multicast address"
    if ip.is_unspecified:
        return "the unspecified address"
    if ip.is_link_local:
        return "a link-local address (cloud metadata services live there)"
    if ip.is_loopback:
        return None if allow_private else "a loopback address"
    if any(ip in net for net in _PRIVATE_NETS if net.version == ip.version):
        return None if allow_private else "a private address"
    if not ip.is_global:
        return "an address that is not globally reachable"
    return None


def _ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


async def resolve_host(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to (a thread runs the resolver: the event loop never waits on DNS)."""
    try:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise EgressRefused(f"{host} could not be resolved: {exc}") from None
    out: list[IPAddress] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        ip = ipaddress.ip_address(str(sockaddr[0]).partition("%")[0])  # a zone id (fe80::1%eth0) dropped
        if ip not in out:
            out.append(ip)
    return out


_tls: ssl.SSLContext | None = None


async def tls_context() -> ssl.SSLContext:
    """The default TLS context (the system's CA store), made once per process in a worker
    thread: loading the store takes 20-50 ms, which on the event loop would stall every stream."""
    global _tls
    if _tls is None:
        _tls = await anyio.to_thread.run_sync(ssl.create_default_context)
    return _tls


def host_names(names: Iterable[str]) -> tuple[str, ...]:
    """Host names as a policy compares them: lowercase, no trailing dot, IPv6 without brackets."""
    return tuple(sorted({n.strip().lower().rstrip(".").strip("[]") for n in names} - {""}))


@dataclass(frozen=True)
class EgressPolicy:
    """``allowed_hosts``: the host names URLs may name (empty: any); ``allow_private``: loopback,
    private and shared addresses allowed (the operator's explicit opt-in)."""

    allowed_hosts: tuple[str, ...] = ()
    allow_private: bool = False

    async def addresses(self, host: str, port: int) -> list[IPAddress]:
        """The checked addresses to connect to for ``host`` (EgressRefused if there is none, or if
        any address it resolves to is refused)."""
        (name,) = host_names([host]) or ("",)
        if not name:
            raise EgressRefused("the URL names no host")
        if self.allowed_hosts and name not in self.allowed_hosts:
            raise EgressRefused(f"{name} is not one of the allowed hosts")
        literal = _ip(name)
        found = [literal] if literal is not None else await resolve_host(name, port)
        if not found:
            raise EgressRefused(f"{name} resolves to no address")
        for ip in found:
            why = refused_because(ip, self.allow_private)
            if why is not None:
                raise EgressRefused(f"{name} resolves to {ip}, {why}")
        return found

    async def send(
        self,
        client: httpx.AsyncClient,
        method: str,
        url: str,
        headers: Mapping[str, str] | None = None,
        content: bytes | None = None,
    ) -> httpx.Response:
        """``method url`` through ``client`` (which must not follow redirects itself), connected
        only to checked addresses, redirects followed (at most ``MAX_REDIRECTS``, each checked
        again). The response is streamed: the caller reads and closes it. Raises EgressRefused,
        or httpx's errors when no checked address answers."""
        sent = dict(headers or {})
        target = httpx.URL(url)
        redirects = 0
        while True:
            response = await self._send_once(client, method, target, sent, content)
            location = response.headers.get("location")
            if response.status_code not in REDIRECT_STATUSES or location is None:
                return response
            await response.aclose()
            redirects += 1
            if redirects > MAX_REDIRECTS:
                raise EgressRefused(f"more than {MAX_REDIRECTS} redirects")
            try:
                target = target.join(location)  # relative to the URL as named (never to the address)
            except httpx.InvalidURL as exc:
                raise EgressRefused(f"a redirect to a bad URL: {exc}") from None
            if response.status_code == 303 or (response.status_code in (301, 302) and method == "POST"):
                method, content = "GET", None  # as browsers and httpx do
                sent = {k: v for k, v in sent.items() if k.lower() not in ("content-type", "content-length")}

    async def _send_once(
        self, client: httpx.AsyncClient, method: str, url: httpx.URL, headers: dict[str, str], content: bytes | None
    ) -> httpx.Response:
        if url.scheme not in DEFAULT_PORTS:
            raise EgressRefused(f"the scheme {url.scheme or '(none)'} is not http or https")
        port = url.port or DEFAULT_PORTS[url.scheme]
        ips = await self.addresses(url.host, port)
        # the Host header as the URL names it (without any user:password@)
        host_header = f"[{url.host}]" if ":" in url.host else url.host
        if url.port is not None:
            host_header += f":{url.port}"
        extensions = {} if _ip(url.host) is not None or url.scheme != "https" else {"sni_hostname": url.host}
        failure: httpx.TransportError = httpx.ConnectError(f"{url.host} has no address")
        for ip in ips:  # the first address that accepts the connection
            request = client.build_request(
                method,
                url.copy_with(host=str(ip)),
                headers={**{k: v for k, v in headers.items() if k.lower() != "host"}, "Host": host_header},
                content=content,
                extensions=extensions,
            )
            try:
                return await client.send(request, stream=True, follow_redirects=False)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                failure = exc
        raise failure


__all__ = ["MAX_REDIRECTS", "EgressPolicy", "EgressRefused", "host_names", "refused_because", "resolve_host"]
