//go:build linux

// Package nsexec runs a function on an OS thread inside another network
// namespace: sockets it creates stay in that namespace, and processes it
// starts are born there. hostd uses it for conntrack in a configured
// namespace; the test rig for everything in its guests.
package nsexec

import (
	"fmt"
	"runtime"

	"github.com/vishvananda/netns"
)

// In runs fn on a locked OS thread inside the namespace at path. If the
// thread cannot be put back into its own namespace afterwards, it stays
// locked, so the Go runtime discards it instead of reusing it.
func In(path string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- err
			return
		}
		defer orig.Close()
		ns, err := netns.GetFromPath(path)
		if err != nil {
			errc <- fmt.Errorf("open netns %s: %w", path, err)
			return
		}
		defer ns.Close()
		if err := netns.Set(ns); err != nil {
			errc <- fmt.Errorf("enter netns %s: %w", path, err)
			return
		}
		err = fn()
		if netns.Set(orig) == nil {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}
