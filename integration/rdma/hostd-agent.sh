#!/bin/sh
# The guest side of TestRDMAHostd: this VM is a host. SoftRoCE on eth0
# (rxe.sh), conntrack and nftables, one namespace guest g1 behind a veth,
# forwarding to the other VM host, and hostd (built with -tags rdma) with
# a peering block. The server VM is h1 (guest 10.77.1.2: an echo), the
# client VM h2 (guest 10.78.1.2: the seeded stream, in parts). Between the
# parts the client's agent flips h2's policy to TCP and back twice, then
# drops the RoCE packets coming into h2 (udp 4791, by tc at eth0's
# ingress, as a fabric fault would: the queue pairs' retries run out and
# both hosts' RDMA links end; not on output, where rxe retries a refused
# send at once, for ever, and starves the vCPU), and checks that the link
# comes back as TCP with the connection on it.
#
# Scenario "remove" (TestRDMARxeRemoved) instead of the flips and the
# fault: while part 3 streams, h2 deletes its rxe device (`rdma link
# delete rxe0`); hostd's RDMA link sees the device's removal begin, ends,
# and so lets the removal finish (rxe in Linux 6.1 waits for every
# process holding the device); the link comes back as TCP, `hostd peers`
# says why, and the connection is back on the relay over it.
#
# Scenario "mpi" (TestRDMAMPI): an Open MPI job of 4 ranks with
# btl/shunt, 2 in each host's guest g1 (btlcheck, every byte checked).
# h1's g1 runs mpirun; orted starts in h2's g1 through the guest
# program's exec server (rsh agent). h1 checks that the relay link to h2
# stayed the one RDMA link made (shunt_relay_links_total 1, still `up
# (rdma)`) and carried the relayed directions' bytes both ways.
#
# Each step says HOSTD-AGENT <STEP>; a failure says HOSTD-AGENT FAIL and
# stops, after both hosts printed their state (the other's on a word
# over TCP port 7999); so does the watchdog after limit seconds.
role=$1 peer=$2 rxe=$3 hostd=$4 guest=$5 cfg=$6 bytes=$7 scenario=${8:-full} limit=${9:-330} mpidir=${10} mpisys=${11}
say() { echo "HOSTD-AGENT $*"; }
stage() { read -r up _ </proc/uptime; say STAGE "$1" at="$up"; }
show() { "$hostd" "$1" -admin /tmp/admin.sock 2>&1 | sed "s/^/HOSTD-AGENT $1: /"; }
dump() {
	say STATE of "$me" "$*"
	counters
	show peers
	show flows
	[ -f /tmp/guest.out ] && sed 's/^/HOSTD-AGENT guest: /' /tmp/guest.out
	[ -f /tmp/hostd.log ] && tail -n 60 /tmp/hostd.log | sed 's/^/HOSTD-AGENT log: /'
}
fail() {
	echo dump | nc -w 2 "$peer" 7999 >/dev/null 2>&1
	dump
	sleep 3 # the other host's state reaches its console
	say FAIL "$@"
	exit 1
}
# until SECONDS CMD...: run CMD every 0.2 s until it succeeds; false
# after SECONDS of the guest's clock (generous: TCG guests on a loaded
# machine, where one run of a Go program takes a second) or once hostd
# has exited.
now() { read -r up _ </proc/uptime; echo "${up%.*}"; }
until_ok() {
	end=$(($(now) + $1))
	shift
	while ! "$@" >/dev/null 2>&1; do
		[ "$(now)" -ge $end ] && return 1
		[ -n "$hp" ] && ! kill -0 "$hp" 2>/dev/null && return 1
		sleep 0.2
	done
}
# exited PID: PID is gone or a zombie (kill -0 succeeds on a zombie)
exited() { st=$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null); [ -z "$st" ] || [ "$st" = Z ]; }
has() { "$hostd" "$1" -admin /tmp/admin.sock 2>/dev/null | grep -q -- "$2"; }
hasnt() { "$hostd" "$1" -admin /tmp/admin.sock >/tmp/out 2>&1 && ! grep -q -- "$2" /tmp/out; }
reload() { cp "$cfg/$me-$1.hcl" /tmp/hostd.hcl && "$hostd" reload -admin /tmp/admin.sock >/dev/null || fail reload "$1"; }

stage rxe
. "$rxe"
if [ "$role" = server ]; then me=h1 net=77 other=78; else me=h2 net=78 other=77; fi
stage net
for m in crypto/crc32c_generic lib/libcrc32c net/netfilter/nfnetlink net/ipv4/netfilter/nf_defrag_ipv4 \
	net/ipv6/netfilter/nf_defrag_ipv6 net/netfilter/nf_conntrack net/netfilter/nf_conntrack_netlink \
	net/netfilter/nf_tables net/netfilter/nft_ct drivers/net/veth net/sched/sch_ingress net/sched/cls_u32 \
	net/sched/act_gact; do
	insmod "$mods/$m.ko" || fail insmod "$m"
done
ip=/usr/bin/ip # busybox's ip knows no netns
mkdir -p /run/netns /tmp/shunt /tmp/marks
$ip netns add g1 || fail netns
$ip link add vg1 type veth peer name eth0 netns g1 || fail veth
$ip addr add 10.$net.1.1/24 dev vg1 && $ip link set vg1 up || fail vg1
$ip -n g1 link set lo up && $ip -n g1 addr add 10.$net.1.2/24 dev eth0 && $ip -n g1 link set eth0 up &&
	$ip -n g1 route add default via 10.$net.1.1 || fail g1
$ip route add 10.$other.0.0/16 via "$peer" || fail route
echo 1 >/proc/sys/net/ipv4/ip_forward
# The operator's firewall: conntrack on (a ct rule); an ingress qdisc on
# eth0 for the fault's filter.
nft -f - <<EOF || fail nft
table inet fw {
	chain forward { type filter hook forward priority 0; policy accept; ct state established,related accept; }
}
EOF
/usr/sbin/tc qdisc add dev eth0 ingress || fail tc qdisc
# The other host's failure asks for this host's state; the watchdog
# prints it before the test's own deadline.
(while :; do nc -l -p 7999 >/dev/null 2>&1 </dev/null && dump asked by the other host; done) &
(sleep "$limit" && dump watchdog && say FAIL watchdog after "$limit" s) &
stage hostd
cp "$cfg/$me-rings.hcl" /tmp/hostd.hcl
"$hostd" check -config /tmp/hostd.hcl 2>&1 | grep -v "^ok" | sed 's/^/HOSTD-AGENT check: /'
"$hostd" agent -config /tmp/hostd.hcl >/tmp/hostd.log 2>&1 &
hp=$!
until_ok 60 "$hostd" status -admin /tmp/admin.sock || fail hostd not up
stage link
until_ok 120 has peers "up (rdma)" || fail the relay link is not up on RDMA
show peers
say LINK rdma
# remove: the rxe device deleted while part 3 streams (scenario remove,
# client only, after part 1 is on the relay).
remove() {
	touch /tmp/marks/go1
	until_ok 240 test -e /tmp/marks/at2 || fail part 2 not echoed
	has peers "up (rdma)" || fail the link is no longer RDMA before the removal
	until_ok 60 has flows "relay h1" || fail not on the relay before the removal
	stage remove
	touch /tmp/marks/go2
	read -r t0 _ </proc/uptime
	rdma link delete rxe0 >/tmp/rdma.out 2>&1 &
	rp=$!
	until_ok 60 hasnt peers "up (rdma)" || fail the RDMA link did not end
	show peers
	say RDMA-ENDED
	# rxe's removal waits for hostd to let go of the device: bounded
	until_ok 60 exited $rp || fail "rdma link delete still waits: $(cat /proc/$rp/stack 2>/dev/null | tr '\n' ' ')"
	wait $rp || fail "rdma link delete: $(cat /tmp/rdma.out)"
	read -r t1 _ </proc/uptime
	[ -e /sys/class/infiniband/rxe0 ] && fail rxe0 still there
	say REMOVED in $(echo "$t0 $t1" | awk '{printf "%.1f", $2-$1}') s
	until_ok 120 has peers "up (tcp)" || fail the link did not come back as TCP
	until_ok 120 has flows "relay h1" || fail the connection is not back on the relay
	show peers
	show flows
	"$hostd" peers -admin /tmp/admin.sock | grep -q "device rxe0 removed" || fail hostd peers does not say why
	grep -q "device rxe0 removed" /tmp/hostd.log || fail the log does not say why
	say DOWNGRADED
	until_ok 240 test -e /tmp/marks/at3 || fail part 3 not echoed
	stage part4
	touch /tmp/marks/go3
	wait $gp || fail the stream
	cat /tmp/guest.out
	stage end
	hostdlog
	show counters
	say DONE
}
# hostdlog: hostd's log lines of the relay's links and switches, or its
# whole log if the test asked for it (SHUNT_RDMA_HOSTD_LOG=1: $cfg/fulllog)
hostdlog() {
	if [ -f "$cfg/fulllog" ]; then
		sed 's/^/HOSTD-AGENT log: /' /tmp/hostd.log
	else
		grep -E "relay link|switch to|bridge stopped|relayed connection ended|never said" /tmp/hostd.log | sed 's/^/HOSTD-AGENT log: /'
	fi
}
# counter NAME: hostd's counter (hostd counters' NAME line), 0 if none
counter() { "$hostd" counters -admin /tmp/admin.sock 2>/dev/null | awk -v k="$1" '$1 == k { print $2; f = 1 } END { if (!f) print 0 }'; }
# mpi: the MPI job (scenario mpi): mpirun on h1, orted on h2 by rsh.
mpi() {
	# the rsh agent: mpirun runs it, and orted checks that it exists
	printf '#!/bin/sh\nexec %s rsh 7777 "$@"\n' "$guest" >/tmp/rsh && chmod +x /tmp/rsh
	if [ "$role" != server ]; then
		stage exec-server
		run exec-server 7777 >/tmp/exec.out 2>&1 &
		until_ok 240 test -e /tmp/mpi.done || fail h1 never said the job was over
		show peers
		"$hostd" counters -admin /tmp/admin.sock | grep relay | sed 's/^/HOSTD-AGENT counters: /'
		say DONE
		return
	fi
	stage wait-h2
	until_ok 120 run rsh 7777 10.78.1.2 true || fail h2 exec server not reachable
	nets=10.77.0.0/16,10.78.0.0/16
	stage mpirun
	# mpirun.openmpi: mpirun is a link through /etc/alternatives, which
	# the VM (the host's /usr only) lacks.
	run_mpi() {
		$ip netns exec g1 env SHUNT_CONTROL=/tmp/shunt/g1.sock timeout 150 /usr/bin/mpirun.openmpi --allow-run-as-root -np 4 \
			--host 10.77.1.2:2,10.78.1.2:2 --bind-to none --mca routed direct --mca plm_rsh_agent /tmp/rsh \
			--mca pml ob1 --mca btl self,vader,shunt --mca oob_tcp_if_include $nets --mca rtc ^hwloc \
			--mca mpi_yield_when_idle 1 --mca mca_component_path "$mpisys:$mpidir" --mca btl_shunt_if_include $nets \
			--mca btl_shunt_port_min 7800 --mca btl_shunt_port_max 7899 --mca btl_shunt_verbose 2 "$mpidir/btlcheck" -m "$bytes"
	}
	run_mpi >/tmp/mpi.out 2>&1
	rc=$?
	sed 's/^/HOSTD-AGENT mpi: /' /tmp/mpi.out
	[ $rc = 0 ] && grep -q "data ok" /tmp/mpi.out || fail "the MPI job: exit $rc"
	stage check
	sleep 1.5 # hostd refreshes its relay counters each second
	links=$(counter 'shunt_relay_links_total{peer=h2}')
	out=$(counter 'shunt_relay_bytes_total{dir=out,peer=h2}')
	in=$(counter 'shunt_relay_bytes_total{dir=in,peer=h2}')
	gathered=$(counter 'shunt_relay_gathered_bytes_total{peer=h2}')
	show peers
	has peers "up (rdma)" || fail the link is no longer RDMA after the job
	say MPI-RDMA links="$links" out="$out" in="$in" gathered="$gathered"
	run rsh 7777 10.78.1.2 touch /tmp/mpi.done
	say DONE
}
run() { $ip netns exec g1 env SHUNT_CONTROL=/tmp/shunt/g1.sock "$guest" "$@"; }
if [ "$scenario" = mpi ]; then
	mpi
elif [ "$role" = server ]; then
	stage echo
	run serve 10.77.1.2:5201 >/tmp/guest.out 2>&1 || fail the echo
	cat /tmp/guest.out
else
	stage part1
	run dial 10.77.1.2:5201 "$bytes" 4 /tmp/marks >/tmp/guest.out 2>&1 &
	gp=$!
	until_ok 240 test -e /tmp/marks/at1 || fail part 1 not echoed
	until_ok 60 has flows "relay h1" || fail the connection is not on the relay
	show flows
	say RELAYED
	if [ "$scenario" = remove ]; then
		remove
		exit
	fi
	# The policy flip loop: to TCP while part 2 streams, back to the rings.
	stage flips
	touch /tmp/marks/go1
	for f in 1 2; do
		reload tcp
		until_ok 60 hasnt flows "relay h1" || fail flip $f: still on the relay
		reload rings
		until_ok 60 has flows "relay h1" || fail flip $f: not back on the relay
		say FLIP $f
	done
	until_ok 240 test -e /tmp/marks/at2 || fail part 2 not echoed
	has peers "up (rdma)" || fail the link is no longer RDMA before the fault
	until_ok 60 has flows "relay h1" || fail not on the relay before the fault
	# The fault: RoCE to this host dropped (by tc, at eth0's ingress: an
	# nftables rule would be a ruleset change, which moves connections to
	# TCP by itself), then part 3 streams: its bytes are on the rings
	# when the queue pairs' retries run out.
	stage fault
	/usr/sbin/tc filter add dev eth0 ingress protocol ip prio 1 u32 match ip protocol 17 0xff \
		match ip dport 4791 0xffff action drop || fail tc drop
	touch /tmp/marks/go2
	until_ok 120 hasnt peers "up (rdma)" || fail the RDMA link did not end
	show peers
	say RDMA-ENDED
	until_ok 120 has peers "up (tcp)" || fail the link did not come back as TCP
	until_ok 120 has flows "relay h1" || fail the connection is not back on the relay
	show peers
	show flows
	say DOWNGRADED
	/usr/sbin/tc filter del dev eth0 ingress prio 1
	until_ok 240 test -e /tmp/marks/at3 || fail part 3 not echoed
	stage part4
	touch /tmp/marks/go3
	wait $gp || fail the stream
	cat /tmp/guest.out
fi
stage end
counters
hostdlog
show counters
# Zero copy: of the bytes the relay sent to the other host (over its
# links, RDMA then TCP), those the NIC read straight from the guest's
# ring (relay's gathers; the counters refresh each second).
sleep 1.5
if [ "$me" = h1 ]; then them=h2; else them=h1; fi
say ZEROCOPY gathered="$(counter "shunt_relay_gathered_bytes_total{peer=$them}")" out="$(counter "shunt_relay_bytes_total{dir=out,peer=$them}")"
say DONE
