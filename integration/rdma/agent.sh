#!/bin/sh
# The guest side of TestRDMASoftRoCE: SoftRoCE on eth0, then the oracle
# (ibv_rc_pingpong, ib_write_bw), the relay's RDMA link (shunt-rdma
# stream) and its queue pair forced into error mid-stream (shunt-rdma
# fault), server or client. Each step says RDMA-AGENT <STEP> on the console; a
# failure says RDMA-AGENT FAIL and stops. STAGE lines carry the guest's
# uptime, so a slow stage shows in the log.
role=$1 peer=$2 rxe=$3 bin=$4 bytes=$5 rounds=$6 secs=$7
say() { echo "RDMA-AGENT $*"; }
stage() { read -r up _ </proc/uptime; say STAGE "$1" at="$up"; }
fail() { counters; say FAIL "$@"; exit 1; }
# client: retry a step until its server listens (at most 240 tries, 2
# minutes: the server may lag far behind under load)
retry() {
	i=0
	until "$@"; do
		i=$((i + 1))
		[ $i -ge 240 ] && return 1
		sleep 0.5
	done
}
. "$rxe"
$bin devices
gid=$($bin devices | sed -n 's/^link would use rxe0 port 1 gid \([0-9]*\)$/\1/p')
[ -n "$gid" ] || fail no gid
say UP gid=$gid
# Small checked streams: under TCG each pass over the bytes (seeding,
# SHA-256, rxe's CRC) runs at a few MB/s, and several times slower on a
# loaded machine; 1 MiB per flow and 2 MiB across the fault say as much.
if [ "$role" = server ]; then
	stage pingpong
	ibv_rc_pingpong -d rxe0 -g "$gid" -n 100 || fail ibv_rc_pingpong
	say PINGPONG-OK
	r=0
	while [ $r -lt "$rounds" ]; do
		stage round$r
		ib_write_bw -d rxe0 -x "$gid" -p 18516 -s 65536 -D "$secs" -F >/dev/null || fail ib_write_bw
		$bin stream -listen :7471 -oneway -check=false -flows 1 -bytes "$bytes" || fail shunt-rdma oneway
		$bin stream -listen :7472 -oneway -check=false -flows 1 -bytes "$bytes" -tcp || fail shunt-rdma tcp oneway
		r=$((r + 1))
	done
	stage bothways
	$bin stream -listen :7473 -flows 4 -bytes 1048576 || fail shunt-rdma both ways
	stage fault
	$bin fault -listen :7474 -bytes 2097152 -at 524288 || fail shunt-rdma fault
else
	stage pingpong
	retry ibv_rc_pingpong -d rxe0 -g "$gid" -n 100 "$peer" || fail ibv_rc_pingpong
	say PINGPONG-OK
	r=0
	while [ $r -lt "$rounds" ]; do
		stage round$r
		out=$(retry ib_write_bw -d rxe0 -x "$gid" -p 18516 -s 65536 -D "$secs" -F "$peer") || fail ib_write_bw
		say WRITEBW round=$r $(echo "$out" | grep -E '^ *65536 ')
		$bin stream -connect "$peer:7471" -oneway -check=false -flows 1 -bytes "$bytes" || fail shunt-rdma oneway
		$bin stream -connect "$peer:7472" -oneway -check=false -flows 1 -bytes "$bytes" -tcp || fail shunt-rdma tcp oneway
		r=$((r + 1))
	done
	stage bothways
	$bin stream -connect "$peer:7473" -flows 4 -bytes 1048576 || fail shunt-rdma both ways
	stage fault
	$bin fault -connect "$peer:7474" -bytes 2097152 -at 524288 || fail shunt-rdma fault
fi
stage end
counters
say DONE
