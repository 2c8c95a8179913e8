//go:build linux

package ruleset

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// nfnetlink constants (linux/netfilter/nfnetlink.h, nf_tables.h).
const (
	groupNFTables    = 7                   // NFNLGRP_NFTABLES
	subsysNFTables   = 10                  // NFNL_SUBSYS_NFTABLES
	msgNewGen        = unix.NFT_MSG_NEWGEN // a transaction's end
	attrTable        = 1                   // NFTA_{TABLE_NAME,CHAIN_TABLE,RULE_TABLE,SET_TABLE,...}: the table, in every object message
	nfgenmsgSize     = 4
	receiveDeadlines = 500 * time.Millisecond
)

// Watch calls changed once per nftables transaction that touched a table
// other than ignore, and after lost events, until ctx ends (then it returns
// nil) or the socket fails. netnsPath names the network namespace whose
// ruleset to watch ("" = the caller's). changed runs on Watch's goroutine.
func Watch(ctx context.Context, netnsPath, ignore string, changed func()) error {
	cfg := &netlink.Config{}
	if netnsPath != "" {
		f, err := os.Open(netnsPath)
		if err != nil {
			return fmt.Errorf("open netns %s for the ruleset watch: %w", netnsPath, err)
		}
		defer f.Close()
		cfg.NetNS = int(f.Fd())
	}
	c, err := netlink.Dial(unix.NETLINK_NETFILTER, cfg)
	if err != nil {
		return fmt.Errorf("ruleset watch: netfilter netlink: %w", err)
	}
	defer c.Close()
	if err := c.JoinGroup(groupNFTables); err != nil {
		return fmt.Errorf("ruleset watch: join the nftables group: %w (is nf_tables loaded? try: modprobe nf_tables)", err)
	}
	_ = c.SetReadBuffer(1 << 20)
	foreign := false
	for {
		if ctx.Err() != nil {
			return nil
		}
		_ = c.SetReadDeadline(time.Now().Add(receiveDeadlines))
		msgs, err := c.Receive()
		switch {
		case err == nil:
		case errors.Is(err, os.ErrDeadlineExceeded):
			continue
		case errors.Is(err, unix.ENOBUFS):
			foreign = false
			changed() // events were lost: any of them may have been a change
			continue
		default:
			return fmt.Errorf("ruleset watch: receive: %w", err)
		}
		for _, m := range msgs {
			t := uint16(m.Header.Type)
			if t>>8 != subsysNFTables {
				continue
			}
			if t&0xff == msgNewGen {
				if foreign {
					changed()
				}
				foreign = false
				continue
			}
			if table(m.Data) != ignore {
				foreign = true
			}
		}
	}
}

// table returns the table an nftables object message names ("" if none).
func table(data []byte) string {
	if len(data) < nfgenmsgSize {
		return ""
	}
	ad, err := netlink.NewAttributeDecoder(data[nfgenmsgSize:])
	if err != nil {
		return ""
	}
	for ad.Next() {
		if ad.Type() == attrTable {
			return ad.String()
		}
	}
	return ""
}
