"""NCCL's RoCE GID choice, emulated on short hand-built tables (``preflight.nccl.gid``)."""

from __future__ import annotations

import pytest

from preflight.nccl.gid import AF_INET, AF_INET6, GidSettings, Slot, gid_family, in_addr_range, ipv4_of, nccl_int, nccl_would_pick_gid, parse_addr_range, parse_gid, parse_gid_settings, valid_gid
from preflight.nccl.ib import ib_hca_selects

V1, V2 = "IB/RoCE v1", "RoCE v2"
EINVAL = "invalid argument (EINVAL)"


def gid(text: str) -> bytes:
    raw = parse_gid(text)
    assert raw is not None
    return raw


LINK_LOCAL = gid("fe80:0000:0000:0000:ba59:9fff:fe3c:10a2")
IPV4 = gid("0000:0000:0000:0000:0000:ffff:0a0a:0011")  # 10.10.0.17
IPV4_OTHER = gid("0000:0000:0000:0000:0000:ffff:c0a8:4d0e")  # 192.168.77.14
IPV6_GLOBAL = gid("fd00:0000:0000:0004:e4ea:71ff:feb9:4970")


def host_table() -> dict[int, Slot]:
    """mlx5 on a bare host: link-local v1/v2, then IPv4 v1/v2."""
    return {0: Slot(LINK_LOCAL, V1), 1: Slot(LINK_LOCAL, V2), 2: Slot(IPV4, V1), 3: Slot(IPV4, V2)}


def pod_table() -> dict[int, Slot]:
    """A macvlan pod: slots 0-3 belong to other namespaces and read as empty."""
    return {4: Slot(IPV4, V1), 5: Slot(IPV4, V2), 6: Slot(LINK_LOCAL, V1), 7: Slot(LINK_LOCAL, V2)}


def test_gid_text_and_shapes() -> None:
    assert parse_gid("0000:0000:0000:0000:0000:ffff:ac13:003c\n") == bytes(10) + b"\xff\xff" + bytes([172, 19, 0, 60])
    assert parse_gid("::ffff:172.19.0.60") is None and parse_gid("") is None and parse_gid("zzzz:" * 7 + "zzzz") is None
    assert ipv4_of(IPV4) == "10.10.0.17" and ipv4_of(LINK_LOCAL) is None
    assert gid_family(IPV4) == AF_INET and gid_family(LINK_LOCAL) == AF_INET6 and gid_family(bytes(16)) == AF_INET6
    assert gid_family(gid("ff0e:0000:0000:0000:0000:ffff:0a0a:0011")) == AF_INET  # IPv4-mapped multicast
    assert not valid_gid(LINK_LOCAL) and not valid_gid(bytes(16)) and not valid_gid(gid("fe80:0000:0000:0000:0000:0000:0000:0000"))
    assert valid_gid(IPV4) and valid_gid(IPV6_GLOBAL)


@pytest.mark.parametrize(
    ("text", "expected"),
    [(None, -1), ("", -1), ("3", 3), (" 3", 3), ("3x", 3), ("0x10", 16), ("010", 8), ("abc", 0), ("-1", -1), ("99999999999999999999", -1)],
)
def test_integer_parameters_parse_like_strtoll(text: str | None, expected: int) -> None:
    assert nccl_int(text, -1) == expected


def test_settings_from_variables() -> None:
    assert parse_gid_settings({}) == GidSettings()
    settings = parse_gid_settings({"NCCL_IB_GID_INDEX": "5", "NCCL_IB_ROCE_VERSION_NUM": "1", "NCCL_IB_ADDR_FAMILY": "AF_INET6"})
    assert settings == GidSettings(5, 1, AF_INET6, "")
    assert parse_gid_settings({"NCCL_IB_ADDR_FAMILY": "inet6"}).family == AF_INET  # only the exact spelling counts


def test_address_ranges_as_nccl_parses_them() -> None:
    assert parse_addr_range("10.10.0.0/16", AF_INET) == (bytes([10, 10, 0, 0]), 16)
    assert parse_addr_range("10.10.0.0", AF_INET) is None  # no "/": ignored
    assert parse_addr_range("10.10.0.0/33", AF_INET) is None
    assert parse_addr_range("fd00::/8", AF_INET) is None  # the other family: ignored
    assert parse_addr_range("10.10.0.0/abc", AF_INET) == (bytes([10, 10, 0, 0]), 0)
    assert in_addr_range(AF_INET, parse_addr_range("10.10.0.0/16", AF_INET), IPV4)
    assert not in_addr_range(AF_INET, parse_addr_range("10.20.0.0/16", AF_INET), IPV4)
    assert not in_addr_range(AF_INET, parse_addr_range("10.10.0.0/-1", AF_INET), IPV4)  # matches nothing
    assert in_addr_range(AF_INET6, parse_addr_range("fd00:0:0:4::/64", AF_INET6), IPV6_GLOBAL)
    assert not in_addr_range(AF_INET6, parse_addr_range("fd00:0:0:5::/64", AF_INET6), IPV6_GLOBAL)


def test_default_choice_is_the_ipv4_roce_v2_gid() -> None:
    choice = nccl_would_pick_gid(host_table(), 256, GidSettings())
    assert (choice.index, choice.forced, choice.einval_reads, choice.failed_read) == (3, False, (), None)


@pytest.mark.parametrize(
    ("settings", "index"),
    [
        (GidSettings(roce_version=1), 2),
        (GidSettings(family=AF_INET6), 0),  # only link-local IPv6 GIDs: NCCL stays on slot 0
        (GidSettings(addr_range="10.10.0.0/24"), 3),
        (GidSettings(addr_range="192.168.0.0/16"), 0),  # matches no GID: stays on slot 0
        (GidSettings(gid_index=7), 7),
    ],
)
def test_choice_follows_the_variables(settings: GidSettings, index: int) -> None:
    assert nccl_would_pick_gid(host_table(), 256, settings).index == index


def test_choice_prefers_the_address_range_among_several_addresses() -> None:
    table = {**host_table(), 4: Slot(IPV4_OTHER, V1), 5: Slot(IPV4_OTHER, V2)}
    assert nccl_would_pick_gid(table, 16, GidSettings()).index == 3  # first v2 of the family wins
    assert nccl_would_pick_gid(table, 16, GidSettings(addr_range="192.168.77.0/24")).index == 5


def test_pod_table_with_leading_holes() -> None:
    choice = nccl_would_pick_gid(pod_table(), 256, GidSettings())
    assert (choice.index, choice.einval_reads) == (5, ())
    # AF_INET6 keeps empty slot 0 as the current GID and reads its type: EINVAL (fatal before 2.26).
    table = {**pod_table(), 8: Slot(IPV6_GLOBAL, V1), 9: Slot(IPV6_GLOBAL, V2)}
    choice = nccl_would_pick_gid(table, 256, GidSettings(family=AF_INET6))
    assert (choice.index, choice.einval_reads) == (9, (0,))


def test_hidden_slot_that_reads_einval() -> None:
    table = {**host_table(), 3: Slot(IPV4, None, EINVAL)}
    choice = nccl_would_pick_gid(table, 16, GidSettings())
    assert choice.einval_reads == (3,) and choice.index == 2 and choice.failed_read is None


def test_missing_type_file_fails_every_version() -> None:
    table = {**host_table(), 3: Slot(IPV4, None, "no such file or directory (ENOENT)")}
    choice = nccl_would_pick_gid(table, 16, GidSettings())
    assert (choice.index, choice.failed_read, choice.error) == (None, 3, "no such file or directory (ENOENT)")


@pytest.mark.parametrize(
    ("setting", "device", "port", "selected"),
    [
        (None, "mlx5_1", 1, True),
        ("mlx5_1", "mlx5_10", 1, True),  # a prefix
        ("=mlx5_1", "mlx5_10", 1, False),
        ("=mlx5_1", "mlx5_1", 1, True),
        ("^mlx5_1", "mlx5_10", 1, False),
        ("^=mlx5_1", "mlx5_10", 1, True),
        ("mlx5_0:2,mlx5_1", "mlx5_0", 1, False),
        ("mlx5_0:2,mlx5_1", "mlx5_0", 2, True),
        ("^", "mlx5_0", 1, False),
        ("", "mlx5_0", 1, True),
    ],
)
def test_ib_hca_grammar(setting: str | None, device: str, port: int, selected: bool) -> None:
    assert ib_hca_selects(setting, device, port) is selected
