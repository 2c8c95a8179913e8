#!/bin/sh
# Guest provisioning: tools, Shunt's guest side (built from /shunt), and the
# MPI benchmark between the guests. Arguments: NAME IP1,IP2
set -eu
name=$1
hosts=$2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends gcc libc6-dev make openmpi-bin libopenmpi-dev sockperf
make -C /shunt preload
install -m 0755 /shunt/bin/shunt-run /usr/local/bin/shunt-run
install -m 0644 /shunt/bin/libshunt-preload.so /usr/local/lib/libshunt-preload.so
# Members of group shunt may use the fast path: the port and the BAR are
# root's alone otherwise (MPI runs as vagrant). udev keeps this across
# reboots.
getent group shunt >/dev/null || groupadd --system shunt
usermod -a -G shunt vagrant 2>/dev/null || true
cat > /etc/udev/rules.d/70-shunt.rules <<'RULES'
SUBSYSTEM=="virtio-ports", ATTR{name}=="org.shunt.ctl*", GROUP="shunt", MODE="0666"
SUBSYSTEM=="pci", ATTR{vendor}=="0x1af4", ATTR{device}=="0x1110", RUN+="/bin/sh -c 'echo 1 > /sys%p/enable; chgrp shunt /sys%p/resource2; chmod 0666 /sys%p/resource2'"
RULES
udevadm control --reload && udevadm trigger --subsystem-match=virtio-ports --subsystem-match=pci || true
# The library finds the ports (org.shunt.ctl, org.shunt.ctl.1) and the BAR
# itself, taking the first port no other process holds; this only shows
# what it will find.
ports=$(grep -l '^org.shunt.ctl' /sys/class/virtio-ports/*/name | xargs -n1 dirname | xargs -n1 basename | tr '\n' ' ')
bar=$(grep -l 0x1110 /sys/bus/pci/devices/*/device | head -n 1 | xargs dirname)
echo 1 > "$bar/enable"
mpicc -O2 -o /usr/local/bin/shunt-mpi-pingpong /shunt/integration/mpi/pingpong.c
echo "$name provisioned: control ports $ports, region $bar/resource2"
# Each process holds one port while it runs: give the library to the ranks
# only (-x LD_PRELOAD), not to orted; up to two ranks per guest.
echo "run the benchmark from g1: mpirun -np 2 --host ${hosts%,*}:1,${hosts#*,}:1 -x LD_PRELOAD=/usr/local/lib/libshunt-preload.so --mca pml ob1 --mca btl self,tcp shunt-mpi-pingpong"
