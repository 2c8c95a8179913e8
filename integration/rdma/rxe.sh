# Sourced by the guests' agents (agent.sh, hostd-agent.sh): SoftRoCE on
# eth0, from the host's /usr (busybox's insmod: the guest has no kmod of
# its own), in dependency order (modules.dep). rxe asks the crypto layer
# for "crc32", which nothing can load on demand here: crc32-pclmul (fast
# with -cpu max) and the generic one go first. The caller defines say and
# fail; this sets mods (the modules' directory) and counters.
mods=/usr/lib/modules/$(uname -r)/kernel
insmod "$mods/arch/x86/crypto/crc32-pclmul.ko" || say no crc32-pclmul
insmod "$mods/crypto/crc32_generic.ko" || fail insmod crc32_generic
for m in net/ipv4/udp_tunnel net/ipv6/ip6_udp_tunnel drivers/infiniband/core/ib_core \
	drivers/infiniband/core/ib_uverbs drivers/infiniband/sw/rxe/rdma_rxe; do
	insmod "$mods/$m.ko" || fail insmod "$m"
done
rdma link add rxe0 type rxe netdev eth0 || fail rdma link add
i=0
until grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null; do
	i=$((i + 1)); [ $i -ge 100 ] && fail rxe0 not active; sleep 0.1
done
# rxe's counters (retries, duplicates, sequence errors), for the log
counters() { grep -H . /sys/class/infiniband/rxe0/ports/1/hw_counters/* 2>/dev/null | sed 's|.*/||' | tr '\n' ' '; echo; }
