//go:build linux

package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/vhost/ivshmem"
)

// The pair-region modes (integration/vm_pair_test.go): a VM talking to
// two peers at once, each pair over a region of its own that hostd
// plugs into both VMs (docs/vm.md, "Pair regions").
//
//	duplex-servers PORT SECS [PORT SECS ...]  accept one connection on each
//	                       PORT, at once; a checked stream each way for SECS
//	                       on each: "DUPLEX-PORT SENT n crc RECV m crc"
//	timed-client ADDR SECS [ADDR SECS ...]  duplex-client to each ADDR, each
//	                       connection made once the one before is on the
//	                       rings; says "FAST i ms" once connection i is on
//	                       the rings, ms after its connect returned (hostd
//	                       plugged the region first, if it had to); the
//	                       first reports as DUPLEX, the others as DUPLEX-i
//
// A first argument "bars" (before "tcp", if any) makes the agent report
// the VM's ivshmem devices whenever they change: "BARS n [ID:A-B ...]",
// each device's region id and pair from its region header ("-" for a
// device without a pair region's header), and the pair regions guestlib
// has mapped: "REGIONS [ids]".
func init() {
	streamModes["duplex-servers"] = duplexServers
	streamModes["timed-client"] = timedClient
}

func duplexServers(c *guestlib.Client, args []string) error {
	if len(args) == 0 || len(args)%2 != 0 {
		return errors.New("usage: duplex-servers PORT SECS [PORT SECS ...]")
	}
	var wg sync.WaitGroup
	errs := make([]error, len(args)/2)
	for i := 0; i < len(args); i += 2 {
		port, secs := args[i], args[i+1]
		l, err := (&guestlib.ListenConfig{Client: c}).Listen(context.Background(), "tcp4", ":"+port)
		if err != nil {
			return err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn, err := l.AcceptShunt()
			if err != nil {
				errs[i/2] = err
				return
			}
			say("ACCEPTED %s", port)
			errs[i/2] = duplexAs(conn, 2, 1, secs, "DUPLEX-"+port)
		}()
	}
	say("LISTENING")
	wg.Wait()
	return errors.Join(errs...)
}

func timedClient(c *guestlib.Client, args []string) error {
	if len(args) == 0 || len(args)%2 != 0 {
		return errors.New("usage: timed-client ADDR SECONDS [ADDR SECONDS ...]")
	}
	var wg sync.WaitGroup
	errs := make([]error, len(args)/2)
	for i := 0; i < len(args); i += 2 {
		n := i / 2
		conn, err := (&guestlib.Dialer{Client: c}).Dial("tcp4", args[i])
		if err != nil {
			return err
		}
		start := time.Now()
		fast := make(chan bool, 1)
		go func() {
			for time.Since(start) < 2*time.Minute {
				if conn.Path().Fast {
					say("FAST %d %d", n, time.Since(start).Milliseconds())
					fast <- true
					return
				}
				time.Sleep(2 * time.Millisecond)
			}
			fast <- false
		}()
		tag := "DUPLEX"
		if n > 0 {
			tag = fmt.Sprintf("DUPLEX-%d", n)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[n] = duplexAs(conn, 1, 2, args[i+1], tag)
		}()
		if i+2 < len(args) && !<-fast {
			break // the next connection is measured once this one is on the rings
		}
	}
	wg.Wait()
	return errors.Join(errs...)
}

// reportBars says BARS and REGIONS lines whenever the VM's ivshmem devices
// or c's mapped pair regions change, until the agent exits.
func reportBars(c *guestlib.Client) {
	var last string
	for {
		devs, _ := ivshmem.List("/sys")
		var names []string
		for _, dev := range devs {
			names = append(names, barName(dev))
		}
		slices.Sort(names)
		ids := c.Regions()
		line := fmt.Sprintf("BARS %d [%s] REGIONS %v", len(devs), strings.Join(names, " "), ids)
		if line != last {
			say("%s", line)
			last = line
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// barName is "ID:A-B" from the region header on ivshmem device dev's BAR,
// or "-" if it shows none (yet).
func barName(dev string) string {
	bar, err := ivshmem.BAR(dev)
	if err != nil {
		return "-"
	}
	r, err := region.Open(bar)
	if err != nil {
		return "-"
	}
	defer r.Close()
	id, a, b := r.Name()
	if id == 0 {
		return "-"
	}
	return fmt.Sprintf("%d:%d-%d", id, a, b)
}
