// Command shunt-vsockd serves the QEMU VMs' vhost-user-vsock devices for
// hostd, in a process of its own so that a hostd restart leaves them
// running: QEMU 7.2 cannot reconnect a vhost-user-vsock device
// (docs/vsock.md, "hostd restarts"). hostd names the devices over the
// control socket (hostd/vsockd) when its configuration has vsockd_socket;
// the guests' connections to hostd's vsock ports are carried to hostd's
// Unix sockets <device socket>_<port>. One per host, as root (QEMU
// connects to the devices' sockets, mode 0600), under its own systemd
// unit (shunt-vsockd.service). Stopping it costs the VMs their vsock
// until each restarts.
//
//	shunt-vsockd [-socket /run/shunt/vsockd.sock] [-log-level info]
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/vsockd"
)

func main() {
	sock := flag.String("socket", "/run/shunt/vsockd.sock", "the control socket hostd connects to (hostd's vsockd_socket)")
	level := flag.String("log-level", "info", "trace, debug, info, warn or error")
	flag.Parse()
	log := hclog.New(&hclog.LoggerOptions{Name: "shunt-vsockd", Level: hclog.LevelFromString(*level), Output: os.Stderr})
	d, err := vsockd.Listen(log, *sock)
	if err != nil {
		fmt.Fprintln(os.Stderr, "shunt-vsockd:", err)
		os.Exit(1)
	}
	log.Info("serving hostd", "socket", *sock, "pid", os.Getpid())
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	s := <-sig
	log.Info("stopping: the VMs' vsock devices close", "signal", s)
	d.Close()
}
