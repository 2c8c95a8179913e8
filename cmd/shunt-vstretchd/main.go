// Command shunt-vstretchd runs inside a VM without a Shunt ivshmem device
// but with virtio-vsock, for the C library (the LD_PRELOAD library and
// btl/shunt): it owns each flow's vsock stream to the host and the
// relay bridge on it, and hands the process the flow's ring pair as a
// memfd, which the C library maps and uses as a region's rings
// (docs/vsock.md, "The C library's stretches"). One per VM, as root or
// any user whose socket the VM's programs can reach.
//
//	shunt-vstretchd [-socket /run/shunt/vstretchd.sock] [-v]
package main

import (
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/shuntnet/shunt/guestlib/vstretch"
)

func main() {
	sock := flag.String("socket", "/run/shunt/vstretchd.sock", "the Unix socket the C library asks (its $SHUNT_VSTRETCHD)")
	verbose := flag.Bool("v", false, "log each stretch")
	flag.Parse()
	if err := run(*sock, *verbose); err != nil {
		fmt.Fprintln(os.Stderr, "shunt-vstretchd:", err)
		os.Exit(1)
	}
}

func run(sock string, verbose bool) error {
	if err := os.MkdirAll(filepath.Dir(sock), 0o755); err != nil {
		return err
	}
	if fi, err := os.Lstat(sock); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return fmt.Errorf("%s exists and is not a socket", sock)
		}
		os.Remove(sock) // a stale one
	}
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: sock, Net: "unixpacket"})
	if err != nil {
		return err
	}
	// Any program of the VM may ask: the stretches a process can open
	// are the flows hostd told it of, and hostd takes a flow's stretch
	// only from this VM, once.
	if err := os.Chmod(sock, 0o666); err != nil {
		return err
	}
	o := vstretch.ServeOptions{}
	if verbose {
		o.Logf = log.Printf
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	go func() { <-sig; l.Close() }()
	log.Printf("shunt-vstretchd: serving %s", sock)
	err = vstretch.Serve(l, o)
	os.Remove(sock)
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}
