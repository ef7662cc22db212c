-- Every charge, in creation order.
SELECT charge_id, order_id, amount_cents
FROM provider_charges
ORDER BY seq
